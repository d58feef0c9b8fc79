"""training/export.py's errors. (Exports that work are checked against the model in test_distributed.py,
FSDP2, and tests/models/test_idefics3.py.)"""

import subprocess
import sys

from tests.models.helpers import tiny_vlm_config


def test_unreadable_shards_are_a_one_line_error(tmp_path):
    """Regression: the command printed torch.distributed.checkpoint's message, every failed rank's whole
    traceback, after the tracebacks of the warnings it logs; now one line naming what each rank met."""
    tiny_vlm_config().save_json(tmp_path / "config.json")
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / ".metadata").write_text("not a checkpoint")
    result = subprocess.run([sys.executable, "-m", "training.export", str(tmp_path)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: rank 0: "), result.stderr
