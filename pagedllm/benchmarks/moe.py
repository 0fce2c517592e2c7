"""Mixture-of-experts decode on the CPU against HF transformers (throughput) and llama.cpp (one stream).

The model is Qwen3-MoE-shaped with random weights: 8 experts, top-2 renormalised, hidden 1024,
--layers decoder layers, expert width --expert-intermediate; transformers builds its config and
weights (`Qwen3MoeConfig`, `Qwen3MoeForCausalLM`, seeded) and saves them as bf16 safetensors, with
the default model's tokenizer (vocabulary 49152). llama.cpp reads the same weights from a BF16
GGUF that gguf-py's writer makes under llama.cpp's `qwen3moe` names and keys (experts stacked into
`ffn_{gate,up,down}_exps`, the tokenizer copied from the default model's GGUF; llama-cpp-python
ships no `convert_hf_to_gguf`). Both are cached under the pagedllm cache directory.

1. Throughput: `pagedllm bench throughput`'s machinery, pagedllm and hf (its best static batch),
   each in a fresh process, on --num-prompts random requests (--input-len-range, --output-len-range).
2. One stream: `pagedllm bench latency`'s measurement (a prompt of --input-len tokens, then
   --output-len greedy decode steps, median of --num-iters) for pagedllm and for llama.cpp on the
   GGUF, the same prompt and threads.

usage: .venv/bin/pagedllm bench moe [--dtype bfloat16] [--skip-throughput] [--skip-latency] [--output-json F]
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from pagedllm.benchmarks.gguf_write import decoder_writer, finish
from pagedllm.benchmarks.script import parser
from pagedllm.utils import cache_dir

_GGUF_TYPES = {"bfloat16": "BF16", "float32": "F32", "float16": "F16"}


def moe_config(layers: int, expert_intermediate: int) -> dict[str, Any]:
    """The Qwen3MoeConfig keyword arguments of the benchmark model."""
    return dict(vocab_size=49152, hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16,
                num_key_value_heads=4, head_dim=64, intermediate_size=4 * 1024,
                moe_intermediate_size=expert_intermediate, num_experts=8, num_experts_per_tok=2,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096,
                rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                bos_token_id=1, eos_token_id=2, pad_token_id=2)


def build_model(layers: int, expert_intermediate: int, dtype: str) -> tuple[str, str]:
    """(HF folder, GGUF path) of the benchmark model, built once and cached."""
    cfg = moe_config(layers, expert_intermediate)
    key = hashlib.sha256(json.dumps([cfg, dtype], sort_keys=True).encode()).hexdigest()[:12]
    folder = cache_dir() / "bench-moe" / f"qwen3moe-{key}"
    gguf_path = folder / f"model.{_GGUF_TYPES[dtype]}.gguf"
    if (folder / "model.safetensors").exists() and gguf_path.exists():
        return str(folder), str(gguf_path)
    import shutil

    import torch
    import transformers as t

    from pagedllm.models.loader import default_hf_folder

    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = t.Qwen3MoeConfig(**cfg)
    hf = t.Qwen3MoeForCausalLM(config).to(getattr(torch, dtype)).eval()
    hf.save_pretrained(str(folder))
    tok = Path(default_hf_folder())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / name, folder / name)
    write_gguf(hf, str(gguf_path), _GGUF_TYPES[dtype])
    return str(folder), str(gguf_path)


def write_gguf(hf: Any, path: str, out_type: str) -> None:
    """`hf` (a Qwen3MoeForCausalLM) as llama.cpp's `qwen3moe` GGUF: tensor names from gguf-py's
    tables, each layer's experts stacked [experts, out, in], 1-D tensors F32, matrices `out_type`;
    the default model's GGUF tokenizer."""
    import gguf
    import numpy as np

    from pagedllm.models.loader import resolve_model

    c = hf.config
    arch = gguf.MODEL_ARCH.QWEN3MOE
    tmp = Path(path).with_suffix(".tmp")
    w = decoder_writer(str(tmp), gguf.MODEL_ARCH_NAMES[arch], c, c.rope_parameters["rope_theta"])
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if out_type == "F32" else f"MOSTLY_{out_type}"))
    reader = gguf.GGUFReader(resolve_model(None).path)
    for name, field in reader.fields.items():
        if name.startswith("tokenizer."):
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(name, field.contents(), vtype, sub_type=sub)
    qtype = getattr(gguf.GGMLQuantizationType, out_type)

    def add(tensor: Any, name: str, bid: int | None = None) -> None:
        data = tensor.detach().float().numpy()
        full = gguf.TENSOR_NAMES[name].format(bid=bid) + ".weight"
        tt = qtype if data.ndim > 1 else gguf.GGMLQuantizationType.F32
        w.add_tensor(full, data if tt == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(data, tt),
                     raw_dtype=tt)

    T = gguf.MODEL_TENSOR
    m = hf.model
    add(m.embed_tokens.weight, T.TOKEN_EMBD)
    for i, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        for tensor, name in ((layer.input_layernorm.weight, T.ATTN_NORM), (a.q_proj.weight, T.ATTN_Q),
                             (a.k_proj.weight, T.ATTN_K), (a.v_proj.weight, T.ATTN_V),
                             (a.o_proj.weight, T.ATTN_OUT), (a.q_norm.weight, T.ATTN_Q_NORM),
                             (a.k_norm.weight, T.ATTN_K_NORM), (layer.post_attention_layernorm.weight, T.FFN_NORM),
                             (mlp.gate.weight, T.FFN_GATE_INP)):
            add(tensor, name, i)
        state = {k: v for k, v in mlp.experts.state_dict().items()}
        for part, name in (("gate_proj", T.FFN_GATE_EXP), ("up_proj", T.FFN_UP_EXP), ("down_proj", T.FFN_DOWN_EXP)):
            add(_stacked(state, part, c.num_experts), name, i)
    add(m.norm.weight, T.OUTPUT_NORM)
    add(hf.lm_head.weight, T.OUTPUT)
    finish(w)
    tmp.replace(path)


def _stacked(state: dict[str, Any], part: str, num_experts: int) -> Any:
    """[experts, out, in] of one projection from transformers' expert module state: per-expert
    `<e>.<part>.weight` matrices, or one fused tensor (`gate_up_proj` [E, 2I, H] / `down_proj`)."""
    import torch

    if f"0.{part}.weight" in state:
        return torch.stack([state[f"{e}.{part}.weight"] for e in range(num_experts)])
    if part == "down_proj":
        return state["down_proj"]
    fused = state["gate_up_proj"]
    half = fused.shape[1] // 2
    return fused[:, :half] if part == "gate_proj" else fused[:, half:]


def run_throughput_part(folder: str, args: Any) -> dict[str, Any]:
    from pagedllm.benchmarks.throughput import format_table, run_throughput
    from pagedllm.benchmarks.workloads import parse_range, random_workload, vocab_info

    in_range = parse_range(args.input_len_range, "--input-len-range")
    out_range = parse_range(args.output_len_range, "--output-len-range")
    reqs = random_workload(args.num_prompts, in_range, out_range, vocab_info(folder), 0)
    info = {"kind": "random", "seed": 0, "input_len_range": list(in_range), "output_len_range": list(out_range)}
    opts = {"backends": ["pagedllm", *args.compare_throughput], "sampling": None, "dtypes": [args.dtype],
            "model": folder, "engine_args": {"seed": 0, "max_model_len": 2048}, "seed": 0,
            "hf_batch_sizes": [8, 16, 32], "hf_probe_prompts": None, "peers_venv": args.peers_venv,
            "vllm_kv_cache_space": 4, "timeout": args.timeout}
    report = run_throughput(reqs, info, opts)
    print(format_table(report))
    return report


def run_latency_part(folder: str, gguf_path: str, args: Any) -> dict[str, Any]:
    import torch

    from pagedllm.benchmarks.latency import run_latency, run_llamacpp_latency
    from pagedllm.benchmarks.throughput import BackendUnavailable

    n = (args.input_len, args.output_len, args.num_iters, args.num_iters_warmup)
    ours = run_latency(folder, {"dtype": args.dtype, "seed": 0}, *n, seed=0)
    try:
        peer = {"ok": True, **run_llamacpp_latency(folder, args.dtype, *n, 0, args.peers_venv,
                                                   torch.get_num_threads(), gguf_path)}
    except BackendUnavailable as exc:
        peer = {"ok": False, "reason": str(exc)}
    row = {"dtype": args.dtype, "pagedllm": ours, "llama.cpp": peer}
    if peer["ok"]:
        row["decode_speedup_vs_llamacpp"] = peer["decode_ms_per_token"] / ours["decode_ms_per_token"]
        row["prefill_speedup_vs_llamacpp"] = peer["prefill_ms"] / ours["prefill_ms"]
        print(f"one stream ({args.dtype}, {args.input_len}-token prompt, {args.output_len} tokens): pagedllm decode "
              f"{ours['decode_ms_per_token']:.2f} ms/token, prefill {ours['prefill_ms']:.1f} ms; llama.cpp "
              f"{peer['decode_ms_per_token']:.2f} ms/token, {peer['prefill_ms']:.1f} ms; pagedllm decode "
              f"{row['decode_speedup_vs_llamacpp']:.2f}x, prefill {row['prefill_speedup_vs_llamacpp']:.2f}x llama.cpp's")
    else:
        print(f"one stream: pagedllm decode {ours['decode_ms_per_token']:.2f} ms/token; llama.cpp skipped: "
              f"{peer['reason']}")
    return row


def main(argv: list[str] | None = None, prog: str | None = None) -> None:
    ap = parser(__doc__, prog)
    ap.add_argument("--dtype", default="bfloat16", choices=tuple(_GGUF_TYPES))
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    ap.add_argument("--expert-intermediate", type=int, default=1536, help="each expert's width (default 1536)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len-range", default="32:128")
    ap.add_argument("--output-len-range", default="16:64")
    ap.add_argument("--compare-throughput", type=lambda s: [b for b in s.split(",") if b], default=["hf"],
                    help="peers of the throughput part (default hf; vllm possible)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--num-iters-warmup", type=int, default=1)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-latency", action="store_true")
    ap.add_argument("--peers-venv", default=None)
    ap.add_argument("--timeout", type=float, default=None, help="seconds one throughput backend may take")
    ap.add_argument("--output-json")
    args = ap.parse_args(argv)
    folder, gguf_path = build_model(args.layers, args.expert_intermediate, args.dtype)
    print(f"model: {folder} (GGUF {Path(gguf_path).name})", file=sys.stderr, flush=True)
    from pagedllm.benchmarks.env import run_metadata

    result: dict[str, Any] = {"benchmark": "moe", "meta": run_metadata(), "args": vars(args),
                              "model": {"folder": folder, "gguf": gguf_path,
                                        "config": moe_config(args.layers, args.expert_intermediate),
                                        "gguf_writer": "gguf-py GGUFWriter (llama-cpp-python ships no converter)"}}
    if not args.skip_throughput:
        result["throughput"] = run_throughput_part(folder, args)
    if not args.skip_latency:
        result["single_stream"] = run_latency_part(folder, gguf_path, args)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2, default=str))
