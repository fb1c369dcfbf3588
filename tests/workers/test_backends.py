"""The backends the worker sets for separating, in this process."""

from __future__ import annotations

import io

import pytest

from stemdeck_watch.workers.tinymodel import tiny_htdemucs
from stemdeck_watch.workers.worker import Worker

torch = pytest.importorskip("torch")

NATIVE = "aten::_native_multi_head_attention"  # nn.MultiheadAttention's fast path


def test_attention_runs_through_scaled_dot_product_not_the_fast_path():
    from torch.profiler import profile

    torch.manual_seed(0)
    model = tiny_htdemucs(heads=2).eval()  # two heads take the fast path; one does not
    mix = torch.randn(1, 2, 4 * 44100, generator=torch.Generator().manual_seed(0)) * 0.1
    fastpath, mkldnn = torch.backends.mha.get_fastpath_enabled(), torch.backends.mkldnn.enabled

    def run(model: object) -> tuple[set[str], object]:
        with torch.inference_mode(), profile() as prof:
            out = model(mix)  # type: ignore[operator]
        return {event.key for event in prof.key_averages()}, out

    try:
        torch.backends.mha.set_fastpath_enabled(True)
        Worker("cpu", io.StringIO())  # sets the backends, as in the worker process
        ops, out = run(model)
        torch.backends.mha.set_fastpath_enabled(True)
        fast_ops, fast_out = run(model)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        torch.backends.mkldnn.enabled = mkldnn
    assert NATIVE in fast_ops, "the tiny model no longer takes the fast path: the test says nothing"
    assert NATIVE not in ops
    assert any("scaled_dot_product" in op for op in ops), sorted(ops)
    assert torch.allclose(out, fast_out, atol=1e-5), "the two paths compute the same attention"
