"""End to end: int8, fp8 and w8a8 (quantized at load) decode like the unquantized model on the HF
prompts; the GGUF kept in 4 bits decodes like the same GGUF expanded to float32."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.quantization import native

from test_correctness_hf import MAX_TOKENS, PROMPTS  # same folder, on sys.path under pytest

pytestmark = pytest.mark.slow


def _run(llm: LLM) -> list[tuple[list[int], list[list[int]]]]:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5,
                                                ignore_eos=True), use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), [list(d) for d in c.logprobs]))
    return res


@pytest.fixture(scope="module")
def reference(one_torch_thread) -> list:
    return _run(LLM(dtype="float32"))


def _agreement(ours: list, ref: list) -> tuple[int, int]:
    """(prompts matching token for token, prompts that satisfy docs/architecture.md's closeness rule)."""
    exact = close = 0
    for (a, a_top), (b, b_top) in zip(ours, ref):
        if a == b:
            exact += 1
            close += 1
            continue
        i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        close += a[i] in b_top[i] and b[i] in a_top[i]
    return exact, close


# Measured (docs/quantization.md): the floors leave a margin below the counts of one run.
# w8a8: 13 exact and 62 close both with its decode rows through torch._int_mm and through the native
# kernel (the same result to the bit) on an AVX-512 host, 10 exact and 64 close on an AVX2 one (one
# ulp of a w8a8 input can move a row's tokens: test_native_decode_quant.py). gguf: where the kernel takes prompts too (AVX2 CPUs: up to
# native.SMALL_M = 256 rows, int8 activations as llama.cpp's), 47 exact and 64 close in one run.
GGUF_MIN_EXACT = 48 if native.SMALL_M <= 16 else 42


@pytest.mark.parametrize("method,min_exact,min_close", [("int8", 32, 62), ("fp8", 16, 58), ("gguf", GGUF_MIN_EXACT, 64),
                                                        ("w8a8", 8, 58)])
def test_quantized_greedy_agrees(reference, method: str, min_exact: int, min_close: int, capsys) -> None:
    ours = _run(LLM(dtype="float32", quantization=method))
    exact, close = _agreement(ours, reference)
    with capsys.disabled():
        print(f"\n{method}: {exact}/{len(PROMPTS)} prompts exact over {MAX_TOKENS} tokens, {close} within top-5")
    assert close >= min_close
    assert exact >= min_exact
