"""One compiled decode function serves every model, dtype and batch a process meets (gpu-check runs the serving
chapters in one process): past Dynamo's default limit of 8 versions it still compiles, where ``fullgraph=True``
would raise. Compiled with the eager backend: its guards and recompiles are the same as Inductor's, in a second."""
import pytest
import torch

from optlab.core.gpt.transformer import GPT, GPTConfig
from optlab.studies.serving import generation as g

LAYERS, DTYPES = (1, 2, 3), (torch.float32, torch.float64, torch.bfloat16)


@pytest.fixture
def eager_decode(monkeypatch):
    """``compiled_decode`` built afresh with the eager backend (the mode is Inductor's, so it is left out)."""
    compile_ = torch.compile
    monkeypatch.setattr(g, "_COMPILED", {})
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, **kw: compile_(fn, backend="eager", **kw))
    torch._dynamo.reset()
    yield g.compiled_decode(torch.device("cpu"))
    torch._dynamo.reset()


def test_the_compiled_decode_compiles_past_the_default_recompile_limit(eager_decode):
    configurations = [(layers, dtype) for layers in LAYERS for dtype in DTYPES]
    assert len(configurations) > torch._dynamo.config.recompile_limit
    token = torch.tensor([[3], [5]])
    for layers, dtype in configurations:
        torch.manual_seed(layers)
        model = GPT(GPTConfig(vocab_size=16, block_size=8, n_layer=layers, n_head=2, n_embd=8)).eval().to(dtype)
        cache = g.StaticKVCache(model, 2, 4)
        with torch.no_grad():
            logits = eager_decode(model, token, cache)
            cache.lengths.zero_()
            assert torch.equal(logits, g.forward_cached(model, token, cache)[:, -1]), (layers, dtype)
    assert torch._dynamo.config.recompile_limit == 8  # raised for the decode only, not for the process
