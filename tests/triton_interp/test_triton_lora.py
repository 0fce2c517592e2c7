"""The Triton LoRA kernels (lora/triton_lora.py) under Triton's interpreter, against PEFT: a tiny
random Llama with three PEFT adapters of ranks 8, 4 and 6 on every linear layer (one with rsLoRA),
laid into pagedllm's slots (fused qkv and gate_up), on rows that mix the adapters with rows of
none. Each layer's delta equals PEFT's lora_B(lora_A(x)) * scaling (float32: within rtol 1e-5,
atol 1e-5; bfloat16 activations and adapters: within 2% of the largest delta of the layer against
float32 PEFT, 1.6% measured: the interpreter casts float32 to bfloat16 toward zero, not to nearest
as a GPU does, and h, the delta and y are each cast); a whole engine on the Triton path gives PEFT's greedy tokens and logprobs (float32,
within 1e-4), and so do decode steps through the CUDA-graph runner's static buffers."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from pagedllm import LLM, LoRARequest, SamplingParams

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported", allow_module_level=True)

from tests.integration.test_lora import PROMPTS, make_adapter, peft_reference  # noqa: E402

pytestmark = pytest.mark.triton_interp

RANKS = {"a8": 8, "b4": 4, "c6": 6}
PEFT_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
                "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
# Rows of slots 0-2 and of none (-1), adapters' rows apart and together, more than one row block.
SLOTS = np.array([0, 1, -1, 2, 0, 0, -1, 1, 2, 2, 2, 0, -1, 1, 0, 2, 1, 1, 0, -1], dtype=np.int32)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from pagedllm.models.testing import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("triton_lora")
    base = make_tiny_checkpoint(str(root / "base"), arch="llama")
    adapters = {name: make_adapter(base, root / name, i + 1, r=r, lora_alpha=2 * r, target_modules="all-linear",
                                   use_rslora=name == "c6")
                for i, (name, r) in enumerate(RANKS.items())}
    return base, adapters


def _peft(base: str, adapters: dict[str, str]):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    names = list(adapters)
    model = PeftModel.from_pretrained(model, adapters[names[0]], adapter_name=names[0]).eval()
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model


def _peft_delta(peft_model, layer_name: str, adapter: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's delta of pagedllm's layer `layer_name` (under the decoder: layers.i...; its fused
    slices side by side) for x."""
    parent, _, leaf = layer_name.rpartition(".")
    outs = []
    for module in PEFT_MODULES[leaf]:
        m = peft_model.base_model.model.model.get_submodule(f"{parent}.{module}")
        outs.append(m.lora_B[adapter](m.lora_A[adapter](x)) * m.scaling[adapter])
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_layer_deltas_equal_peft(setup, dtype, monkeypatch):
    from pagedllm.lora.layers import slot_order

    base, adapters = setup
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, dtype=dtype, device="cpu", num_kv_blocks=16,
              block_size=16)
    lora = llm.llm_engine.executor.runner.lora
    assert lora.triton and lora.kernel is None
    names = list(adapters)
    slots = [lora._slot(i + 1, adapters[n], set()) for i, n in enumerate(names)]
    peft_model = _peft(base, adapters)
    order, rows = slot_order(np.array([slots[s] if s >= 0 else -1 for s in SLOTS], dtype=np.int32), 3)
    order = torch.from_numpy(order)
    gen = torch.Generator().manual_seed(0)
    wdt = getattr(torch, dtype)
    for name, method in lora.methods.items():
        layer = lora.layers[name]
        x = torch.randn(len(SLOTS), layer.in_features, generator=gen).to(wdt)
        y0 = torch.randn(len(SLOTS), layer.out_features, generator=gen).to(wdt)
        y = y0.clone()
        method._triton(x, y, order, rows)
        with torch.no_grad():
            want = torch.stack([y0[t].float() + (_peft_delta(peft_model, name, names[s], x[t : t + 1].float())[0]
                                                 if s >= 0 else 0.0) for t, s in enumerate(SLOTS)])
        assert torch.equal(y[SLOTS < 0], y0[SLOTS < 0]), name  # rows without an adapter are untouched
        if dtype == "float32":
            torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, msg=name)
        else:
            delta = (want - y0.float())[SLOTS >= 0]
            err = (y.float() - want)[SLOTS >= 0].abs().max()
            assert err <= 0.02 * delta.abs().max(), (name, float(err), float(delta.abs().max()))


def _engine_tokens(llm, requests, plan):
    outs = llm.generate([PROMPTS[p] for _, p in plan], SamplingParams(max_tokens=6, temperature=0, logprobs=0),
                        lora_request=[requests[a] if a else None for a, _ in plan], use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                          o.outputs[0].token_ids)]) for o in outs]


def _check_against_peft(base, adapters, plan, got):
    for (name, p), (tokens, logprobs) in zip(plan, got):
        ref_tokens, ref_logprobs = peft_reference(base, adapters[name] if name else None, PROMPTS[p])
        assert tokens == ref_tokens[: len(tokens)], (name, p)
        assert logprobs == pytest.approx(ref_logprobs[: len(tokens)], abs=1e-4), (name, p)


PLAN = [("a8", 0), (None, 1), ("b4", 2), ("c6", 3), ("a8", 1)]


def test_engine_on_the_triton_path_equals_peft(setup, monkeypatch):
    base, adapters = setup
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=8, dtype="float32", device="cpu",
              num_kv_blocks=32, block_size=16)
    requests = {n: LoRARequest(n, i + 1, path) for i, (n, path) in enumerate(adapters.items())}
    _check_against_peft(base, adapters, PLAN, _engine_tokens(llm, requests, PLAN))


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: replaying re-runs the captured forward pass
    on the static buffers (the LoRA kernels reading the static slot order), as a replay computes."""

    def __init__(self, graphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs.outputs[self.size] = self.graphs._forward(self.size)


def test_decode_steps_through_the_graphs_static_slot_order_equal_peft(setup, monkeypatch):
    """LoRA decode steps take the CUDA-graph path (static buffers padded to 4 and 8 rows, the
    rows' slots written into the static order before each replay): PEFT's tokens; an adapter
    loaded after the graphs were made only changes its slot's contents."""
    from pagedllm.worker.cuda_graph import CudaGraphRunner

    base, adapters = setup
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    llm = LLM(base, enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32", device="cpu",
              num_kv_blocks=32, block_size=16)
    runner = llm.llm_engine.executor.runner
    graphs = CudaGraphRunner(runner.model, (4, 8), max_blocks_per_seq=8, sliding_window=0, num_splits={},
                             device=runner.device, context=runner.forward_context, lora=runner.lora)
    graphs.graphs = {b: _EagerReplay(graphs, b) for b in graphs.sizes}
    runner.cuda_graphs = graphs
    assert runner.paths.cuda_graph.lora
    replays = []
    original = graphs.run
    graphs.run = lambda batch, slots=None: replays.append(slots is not None) or original(batch, slots)
    requests = {n: LoRARequest(n, i + 1, path) for i, (n, path) in enumerate(adapters.items())}
    plan = [("a8", 0), (None, 1), ("b4", 2)]
    _check_against_peft(base, adapters, plan, _engine_tokens(llm, requests, plan))
    later = [("c6", 3), ("a8", 1), (None, 0)]  # c6 takes a slot another adapter held
    _check_against_peft(base, adapters, later, _engine_tokens(llm, requests, later))
    assert any(replays) and 3 in runner.lora.slots and runner.cuda_graphs is graphs


@pytest.mark.slow
def test_gpu_check_lora_part_runs_on_the_triton_path(tmp_path, monkeypatch):
    """gpu_check's LoRA part (tiny shapes, no graphs on the CPU): the Triton and torch-loop runs
    agree, every adapter row changes, and the report prints both lines."""
    from pagedllm.benchmarks import gpu_check
    from pagedllm.benchmarks.gpu_check_lora import lora_check
    from pagedllm.models.testing import make_tiny_checkpoint

    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "triton")
    tok = make_tiny_checkpoint(str(tmp_path / "tok"), arch="llama")
    tiny = gpu_check.llama_config("tiny", 96)
    result = lora_check(tiny, tiny, tok, tmp_path, "cpu", requests=3, prompt_len=8, max_tokens=3)
    a, t = result["agreement"], result["timing"]
    assert a["passed"] and a["adapter_rows"] == 8, a
    assert t["base_tok_s"] > 0 and t["lora_graphs_triton_tok_s"] > 0 and t["lora_eager_torch_loop_tok_s"] > 0
    report = gpu_check.markdown_report({"lora": result})
    assert "eager Triton 12/12 equal to the eager torch loop; adapters changed 8/8" in report
    assert "LoRA output tok/s, 3 requests x 3 tokens" in report
