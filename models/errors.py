"""The project's own error type: every CLI catches `TinyVLMError` and prints its one-line message."""


class TinyVLMError(Exception):
    """Base of the errors a user can cause and fix (config, checkpoint, data, prompt, generation settings)."""


class InputError(TinyVLMError, ValueError):
    """Inputs that do not fit the model: images of the wrong shape, or image tokens that do not match the
    images."""
