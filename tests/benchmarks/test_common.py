"""benchmarks/common.py's kernel table: what a call runs, counted per call and named by kind."""

import torch

from benchmarks.common import kernel_kind, kernel_table


def test_the_kernel_table_counts_each_operator_per_call_with_its_kind():
    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def call() -> None:
        torch.mm(a, b)
        torch.mm(b, a)
        torch.nn.functional.cross_entropy(a, torch.zeros(64, dtype=torch.long))

    lines = kernel_table(call, 3, torch.device("cpu"))
    rows = {line.split(" | ")[0].removeprefix("| "): line.split(" | ")[1:] for line in lines
            if line.startswith("| aten::")}
    assert rows["aten::mm"][:2] == ["matmul", "2"]  # two a call, over 3 calls
    assert rows["aten::_log_softmax"][:2] == ["loss", "1"]
    assert lines[0].startswith("operators (own CPU time) a call: ")
    names = ("flash_fwd_kernel", "triton_per_fused__log_softmax_3", "multi_tensor_apply_kernel<FusedAdam>",
             "sm90_xmma_gemm_bf16", "triton_red_fused_rsqrt_mean_pow", "triton_poi_fused_mul_silu")
    assert [kernel_kind(name) for name in names] == [
        "attention", "loss", "optimizer", "matmul", "norm", "elementwise / other"]
