"""Pooling on the engine, offline: embeddings against sentence-transformers, every pooling type
with normalisation and dimensions against torch on transformers' hidden states, cross-encoder
scores against sentence-transformers' CrossEncoder, decoder (LAST) pooling against transformers,
chunked prompts, pooling beside generation in one engine, prefix caching, and errors.

Tolerances: float32 throughout; pagedllm against transformers / sentence-transformers within
1e-5 per value (cosine >= 0.9999 per text for the packaged model, the stated target); pagedllm
against itself where only the chunking or the batch differs (other matmul shapes, so other
rounding) within 1e-5.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, PoolingParams
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.models.loader.pooling import MINILM_PIP
from pagedllm.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXTS = [
    "A man is eating food.",
    "The quick brown fox jumps over the lazy dog, twice, and then sleeps in the afternoon sun.",
    "pagedllm embeds texts",
    "Paris",
]
SMALL = {"dtype": "float32", "kv_cache_memory": "64MiB"}

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("all_minilm_l6_v2") is None, reason=f"needs all-MiniLM-L6-v2: {MINILM_PIP}")


# ---- all-MiniLM-L6-v2 (sentence-transformers' folder, BERT encoder) ------------------------------
@pytest.fixture(scope="module")
def minilm() -> LLM:
    return LLM("all-minilm-l6-v2", **SMALL)


@pytest.fixture(scope="module")
def st_model(minilm: LLM):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm.llm_engine.model_config.path, device="cpu")


@needs_minilm
def test_minilm_equals_sentence_transformers(minilm: LLM, st_model) -> None:
    assert minilm.llm_engine.model_config.runner == "pooling"
    pooler = minilm.llm_engine.model_config.pooler_config
    assert (pooler.pooling_type, pooler.normalize) == ("MEAN", True)  # from modules.json / 1_Pooling
    assert minilm.llm_engine.model_config.max_model_len == 256  # sentence_bert_config.json
    ours = torch.tensor([o.outputs.embedding for o in minilm.embed(TEXTS, use_tqdm=False)])
    ref = st_model.encode(TEXTS, convert_to_tensor=True, batch_size=32)
    cos = F.cosine_similarity(ours, ref, dim=1)
    assert cos.min() >= 0.9999, cos
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)


@needs_minilm
def test_token_ids_equal_text(minilm: LLM) -> None:
    tok = minilm.get_tokenizer()
    by_text = minilm.embed(TEXTS, use_tqdm=False)
    by_ids = minilm.embed([{"prompt_token_ids": tok.encode(t)} for t in TEXTS], use_tqdm=False)
    for a, b in zip(by_text, by_ids):
        assert a.prompt_token_ids == b.prompt_token_ids
        assert a.outputs.embedding == b.outputs.embedding


def _reference(st_model, text: str, kind: str, normalize: bool, dims: int | None) -> torch.Tensor:
    """Torch pooling over transformers' hidden states (the sentence-transformers model's encoder)."""
    bert = st_model[0].auto_model
    enc = st_model.tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        h = bert(**enc).last_hidden_state[0].float()
    vec = {"MEAN": h.mean(0), "CLS": h[0], "LAST": h[-1], "ALL": h}[kind]
    if dims is not None:
        vec = vec[..., :dims]
    return F.normalize(vec, dim=-1) if normalize else vec


@needs_minilm
@pytest.mark.parametrize("kind", ["MEAN", "CLS", "LAST", "ALL"])
@pytest.mark.parametrize("normalize,dims", [(True, None), (False, None), (True, 64), (False, 17)])
def test_pooling_types_normalize_dimensions(minilm: LLM, st_model, kind: str, normalize: bool,
                                            dims: int | None) -> None:
    params = PoolingParams(task="encode", pooling_type=kind, normalize=normalize, dimensions=dims)
    outs = minilm.encode(TEXTS[:2], params, use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        ref = _reference(st_model, text, kind, normalize, dims)
        assert out.outputs.data.shape == ref.shape
        torch.testing.assert_close(out.outputs.data, ref, atol=1e-5, rtol=0)


@needs_minilm
def test_embedding_errors(minilm: LLM) -> None:
    with pytest.raises(ValueError, match="dimensions=999"):
        minilm.embed(TEXTS[:1], pooling_params=PoolingParams(dimensions=999), use_tqdm=False)
    with pytest.raises(ValueError, match="maximum context length is 256"):
        minilm.embed(["word " * 300], use_tqdm=False)
    with pytest.raises(ValueError, match="runner='pooling'"):
        minilm.generate("hello")
    with pytest.raises(ValueError, match="no classifier head"):
        minilm.classify(TEXTS[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams(pooling_type="MAX")
    assert not minilm.llm_engine.has_unfinished_requests()


@needs_minilm
def test_encoder_prompt_is_never_chunked() -> None:
    llm = LLM("all-minilm-l6-v2", max_num_batched_tokens=16, **SMALL)
    with pytest.raises(ValueError, match="max_num_batched_tokens=16"):
        llm.embed([TEXTS[1]], use_tqdm=False)  # 20 tokens: over one step's budget
    short = llm.embed(TEXTS[2:], use_tqdm=False)  # each fits whole; together they take two steps
    assert all(len(o.outputs.embedding) == 384 for o in short)


@needs_minilm
def test_minilm_score_is_cosine(minilm: LLM, st_model) -> None:
    out = minilm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)
    ref = st_model.encode(TEXTS, convert_to_tensor=True)
    want = F.cosine_similarity(ref[:1], ref[1:], dim=1)
    torch.testing.assert_close(torch.tensor([o.outputs.score for o in out]), want, atol=1e-5, rtol=0)


# ---- a cross-encoder: tiny random BertForSequenceClassification ---------------------------------
def _bert_tokenizer(folder):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    words = sorted({w.strip(".,?").lower() for t in TEXTS + QUERIES + DOCS for w in t.split()})
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    tok = BertTokenizerFast(tokenizer_object=backend, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                            unk_token="[UNK]", mask_token="[MASK]")
    tok.save_pretrained(folder)
    return tok


QUERIES = ["what is a panda?", "capital of france"]
DOCS = ["The giant panda is a bear species endemic to China.", "hi there", "Paris is the capital of France.",
        "Bears eat bamboo and sleep."]


def _cross_encoder(folder, num_labels: int) -> str:
    from transformers import BertConfig, BertForSequenceClassification

    tok = _bert_tokenizer(folder)
    cfg = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=64, num_labels=num_labels,
                     initializer_range=0.3)
    torch.manual_seed(1)
    BertForSequenceClassification(cfg).eval().save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory) -> str:
    return _cross_encoder(tmp_path_factory.mktemp("ce"), 1)


def test_cross_encoder_scores_and_order(cross_encoder_dir: str) -> None:
    from sentence_transformers import CrossEncoder

    llm = LLM(cross_encoder_dir, **SMALL)
    assert llm.llm_engine.model_config.runner == "pooling"
    ce = CrossEncoder(cross_encoder_dir, device="cpu")
    for q in QUERIES:
        ours = [o.outputs.score for o in llm.score(q, DOCS, use_tqdm=False)]
        ref = ce.predict([(q, d) for d in DOCS], activation_fn=torch.nn.Sigmoid())
        torch.testing.assert_close(torch.tensor(ours), torch.tensor(ref), atol=1e-5, rtol=0)
        assert sorted(range(len(DOCS)), key=lambda i: -ours[i]) == sorted(range(len(DOCS)), key=lambda i: -ref[i])
    pairs = llm.score(QUERIES, DOCS[:2], use_tqdm=False)  # N:N
    assert len(pairs) == 2
    with pytest.raises(ValueError, match="one to one"):
        llm.score(QUERIES, DOCS, use_tqdm=False)


def test_classifier_softmax(tmp_path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = _cross_encoder(tmp_path, 3)
    llm = LLM(folder, **SMALL)
    outs = llm.classify(DOCS, use_tqdm=False)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        for doc, out in zip(DOCS, outs):
            want = torch.softmax(model(**tok(doc, return_tensors="pt")).logits[0], -1)
            assert out.outputs.num_classes == 3
            torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=1e-5, rtol=0)


# ---- decoders: LAST pooling (Qwen3-Embedding-shaped), chunking, mixing with generation -----------
@pytest.fixture(scope="module")
def qwen3_embedding_dir(tmp_path_factory) -> str:
    from transformers import Qwen3Config, Qwen3Model

    from pagedllm.models.testing import build_tiny_tokenizer

    folder = tmp_path_factory.mktemp("qwen3emb")
    tok = build_tiny_tokenizer()
    cfg = Qwen3Config(architectures=["Qwen3Model"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=len(tok),
                      max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True)
    torch.manual_seed(2)
    Qwen3Model(cfg).eval().save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


LONG = [("the cat sat on the mat and then " * 6).strip(), "short one", ("numbers 1 2 3 4 5 6 7 8 9 " * 4).strip()]


def test_decoder_last_pooling_against_transformers(qwen3_embedding_dir: str) -> None:
    from transformers import AutoTokenizer, Qwen3Model

    llm = LLM(qwen3_embedding_dir, **SMALL)
    mc = llm.llm_engine.model_config
    assert (mc.runner, mc.pooler_config.pooling_type, mc.pooler_config.normalize) == ("pooling", "LAST", True)
    outs = llm.embed(LONG, use_tqdm=False)
    model = Qwen3Model.from_pretrained(qwen3_embedding_dir).eval()
    tok = AutoTokenizer.from_pretrained(qwen3_embedding_dir)
    with torch.no_grad():
        for text, out in zip(LONG, outs):
            h = model(**tok(text, return_tensors="pt")).last_hidden_state[0, -1]
            torch.testing.assert_close(torch.tensor(out.outputs.embedding), F.normalize(h, dim=0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS", "ALL"])
def test_chunked_decoder_pooling_equals_unchunked(qwen3_embedding_dir: str, kind: str) -> None:
    params = PoolingParams(task="encode", pooling_type=kind)
    whole = LLM(qwen3_embedding_dir, **SMALL).encode(LONG, params, use_tqdm=False)
    chunked_llm = LLM(qwen3_embedding_dir, max_num_batched_tokens=8, long_prefill_token_threshold=5, **SMALL)
    chunked = chunked_llm.encode(LONG, params, use_tqdm=False)
    assert max(len(o.prompt_token_ids) for o in chunked) > 8  # the long prompts took several steps
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a.outputs.data, b.outputs.data, atol=1e-5, rtol=0)


def _drain(engine: LLMEngine) -> tuple[dict, bool]:
    outs, mixed = {}, False
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        kinds = {rid[0] for rid in engine.core.last_output.num_scheduled_tokens}  # "g..." or "p..."
        mixed |= kinds == {"g", "p"}
    return outs, mixed


@pytest.mark.parametrize("runner", ["pooling", "generate"])
def test_pooling_and_generation_share_steps(tiny_model_dir: str, runner: str) -> None:
    """A generate model, served with either runner, takes both kinds of request in one engine;
    each comes out as it does alone."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, runner=runner, **SMALL))
    gen = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    pool = PoolingParams(task="embed")
    prompts = ["hello there, how are", "the weather today", "once upon a time there was", "a list: 1, 2, 3"]

    def run(kinds: str) -> tuple[dict, bool]:
        for i, (k, p) in enumerate(zip(kinds, prompts)):
            if k != "-":
                engine.add_request(f"{k}{i}", p, gen if k == "g" else pool)
        return _drain(engine)

    alone_gen, _ = run("g-g-")
    alone_pool, _ = run("-p-p")
    both, mixed = run("gpgp")
    assert mixed, "no step ran a pooling request beside a generation one"
    for rid in ("g0", "g2"):
        assert both[rid].outputs[0].token_ids == alone_gen[rid].outputs[0].token_ids
    for rid in ("p1", "p3"):
        torch.testing.assert_close(both[rid].outputs.data, alone_pool[rid].outputs.data, atol=1e-5, rtol=0)


def test_prefix_cache_only_for_last_pooling(qwen3_embedding_dir: str) -> None:
    llm = LLM(qwen3_embedding_dir, block_size=4, **SMALL)
    for kind, cached in (("LAST", True), ("MEAN", False)):
        params = PoolingParams(task="encode", pooling_type=kind)
        first = llm.encode(LONG[:1], params, use_tqdm=False)[0]
        again = llm.encode(LONG[:1], params, use_tqdm=False)[0]
        assert (again.num_cached_tokens > 0) is cached
        torch.testing.assert_close(first.outputs.data, again.outputs.data, atol=1e-5, rtol=0)


def test_generate_runner_pools_last_token(tiny_model_dir: str) -> None:
    """A generate-runner decoder embeds: its last token's final hidden state, normalised (against
    transformers' last_hidden_state), beside its own generation; --pooler-config sets the defaults."""
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_model_dir, **SMALL)
    assert llm.llm_engine.model_config.runner == "generate"
    prompts = ["hello there, how are", "the weather today", "once upon a time there was"]
    ours = llm.embed(prompts, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()
    for o in ours:
        with torch.no_grad():
            last = hf.model(torch.tensor([o.prompt_token_ids])).last_hidden_state[0, -1]
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), F.normalize(last, dim=0), atol=1e-5, rtol=0)
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids
    config = EngineArgs(model=tiny_model_dir, pooler_config='{"pooling_type": "MEAN"}').create_engine_config()
    assert config.model_config.runner == "generate" and config.model_config.pooler_config.pooling_type == "MEAN"
    with pytest.raises(ValueError, match="unknown keys"):
        EngineArgs(model=tiny_model_dir, pooler_config='{"pooling": "MEAN"}')
