"""Memory per GPU and communication per step of the supported layouts, from a model's config.

    python scripts/scaling_tables.py                     # markdown tables for docs/scaling.md
    python scripts/scaling_tables.py --json              # the same numbers as JSON
    python scripts/scaling_tables.py --model llama-3.1-8b --gpus 64 128 --seq 32768

Every number is arithmetic on posttrain.core.model.get_preset(...) shapes; the formulas are in the
docstrings below and, with worked examples, in docs/scaling.md. Assumptions (all arguments):
bf16 compute with fp32 master weights, fp32 gradients and AdamW states (FSDP2 mixed precision,
reduce in fp32); micro-batch of 1 sequence per data-parallel rank; 8 GPUs per node (NVLink inside,
InfiniBand across); the layout's dims ordered (pp, dp_replicate, dp_shard, cp, tp), tp innermost,
as core/parallel/mesh.py builds them; MoE layers token-sharded over tp (experts replicated over
tp, split over ep), as core/parallel/expert.py does.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

from posttrain.core.model.args import ModelArgs, get_preset

GB = 1e9
GPUS = {"H100": dict(mem_gb=80.0), "H200": dict(mem_gb=141.0)}
NVLINK_GBPS = 450.0  # per GPU, one direction (NVLink 4: 900 GB/s both ways)
IB_GBPS = 50.0  # per GPU, 400 Gb/s NDR
PEAK_TFLOPS = 989.0  # dense bf16, H100 and H200 alike
MFU = 0.40
RESERVED_GB = 6.0  # CUDA context, NCCL buffers, allocator fragmentation
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Layout:
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    def name(self) -> str:
        parts = [f"{k}{v}" for k, v in (("pp", self.pp), ("hsdp-rep", self.dp_replicate), ("fsdp", self.dp_shard),
                                         ("cp", self.cp), ("tp", self.tp), ("ep", self.ep)) if v > 1]
        return " x ".join(parts) or "single"

    def intra_node(self, dim: str) -> bool:
        """A dim's groups stay inside a node when it and every dim inside it fit in one node. ep
        groups are ep consecutive ranks of the flattened (dp_shard, cp), each tp ranks apart."""
        if dim == "ep":
            return self.ep * self.tp <= GPUS_PER_NODE
        order = ["tp", "cp", "dp_shard", "dp_replicate", "pp"]
        span = 1
        for d in order[: order.index(dim) + 1]:
            span *= getattr(self, d)
        return span <= GPUS_PER_NODE


def param_counts(m: ModelArgs) -> dict[str, float]:
    """Parameters: per layer (attention incl. norms; dense MLP or experts + router), embeddings."""
    h, hd = m.hidden_size, m.head_dim
    attn = h * hd * (2 * m.num_heads + 2 * m.num_kv_heads) + 2 * h
    expert = dense = 0.0
    for i in range(m.num_layers):
        if m.is_moe_layer(i):
            expert += m.moe.num_experts * 3 * h * m.moe.intermediate_size
            dense += h * m.moe.num_experts + 3 * h * m.moe.shared_intermediate_size
        else:
            dense += 3 * h * m.intermediate_size
    emb = m.vocab_size * h * (1 if m.tie_embeddings else 2) + h
    total = m.num_layers * attn + dense + expert + emb
    active = total - expert + (expert * m.moe.top_k / m.moe.num_experts if m.moe else 0)
    return dict(attn_per_layer=attn, dense=dense, expert=expert, emb=emb, total=total, active=active)


def activation_elems_per_token_layer(m: ModelArgs) -> float:
    """Elements saved for backward per token per layer, no recompute (flash/SDPA attention, so
    no T x T scores): attn_norm in, normed, q, k, v, attention out (= o_proj in), mlp_norm in,
    normed; SwiGLU: gate, up, silu(gate), product (= down in). MoE: router scores and, per
    routed copy (top_k), its input row and the four SwiGLU tensors of the expert."""
    h, kv = m.hidden_size, m.num_kv_heads * m.head_dim
    q = m.num_heads * m.head_dim
    attn = 2 * h + q + 2 * kv + q + h + h  # norm in, normed, q, k, v, out, mlp_norm in, normed
    if m.moe is not None:
        mlp = m.moe.num_experts + m.moe.top_k * (h + 4 * m.moe.intermediate_size) + 4 * m.moe.shared_intermediate_size
    else:
        mlp = 4 * m.intermediate_size
    return attn + mlp


@dataclass
class Row:
    model: str
    gpus: int
    layout: str
    state_gb: float  # fp32 master + fp32 grads + AdamW m, v (sharded)
    gathered_gb: float  # bf16 weights of the blocks FSDP holds gathered + one fp32 unsharded block grad
    act_gb: float  # activations, no recompute
    act_ckpt_gb: float  # with per-block activation checkpointing
    total_ckpt_gb: float
    intra_gb: float  # bytes each GPU sends per optimizer step over NVLink
    inter_gb: float  # ... over InfiniBand
    comm_s: float  # intra / NVLink + inter / IB, if nothing overlapped
    compute_s: float  # at MFU of peak, with the recompute
    grad_accum: int


def estimate(name: str, m: ModelArgs, L: Layout, seq: int, global_batch: int, micro_batch: int = 1) -> Row:
    """One optimizer step of `global_batch` sequences of `seq` tokens; `micro_batch` sequences per
    data-parallel rank per forward, grad_accum = global_batch / (dp_replicate * dp_shard * micro_batch)."""
    p = param_counts(m)
    dp = L.dp_replicate * L.dp_shard
    accum = max(1, math.ceil(global_batch / (dp * micro_batch)))
    shard = L.dp_shard * L.cp  # FSDP shards over dp_shard x cp
    # -- persistent state: 16 bytes per parameter (4 master + 4 grad + 8 Adam), sharded
    ne = p["total"] - p["expert"]  # non-expert parameters: split by tp, pp, then FSDP
    ne_gpu = ne / (L.tp * L.pp * shard)
    ex_gpu = p["expert"] / (L.pp * shard)  # replicated over tp; ep x (dp_shard*cp/ep) = dp_shard*cp
    state = 16 * (ne_gpu + ex_gpu)
    # -- transient: two blocks of bf16 weights gathered (current + prefetch), one fp32 block grad
    layer_ne = (ne - p["emb"]) / m.num_layers / L.tp
    layer_ex = p["expert"] / m.num_layers  # gathered over dp_shard*cp/ep only, i.e. E/ep experts
    layer_ex /= L.ep
    gathered = (2 * 2 + 4) * (layer_ne + layer_ex)
    # -- activations, bf16, per micro-batch; tokens split by cp, everything by tp (SP + TP / token-sharded MoE)
    tokens = micro_batch * seq / L.cp
    per_layer = activation_elems_per_token_layer(m) * 2 * tokens / L.tp
    layers = m.num_layers  # 1F1B: stage 0 holds pp microbatches of L/pp layers = L layers' worth
    act = per_layer * layers
    act_ckpt = 2 * m.hidden_size * tokens / L.tp * layers + per_layer  # block inputs + one recomputed block
    # -- communication, bytes sent per GPU per step
    intra = inter = 0.0

    def add(dim: str, nbytes: float) -> None:
        nonlocal intra, inter
        if L.intra_node(dim):
            intra += nbytes
        else:
            inter += nbytes

    if shard > 1:  # FSDP: all-gather bf16 forward + backward, reduce-scatter fp32, every micro-batch
        frac = (shard - 1) / shard
        add("dp_shard", accum * frac * (2 + 2 + 4) * (ne / (L.tp * L.pp)))
        if L.ep > 1:
            e_shard = shard // L.ep
            if e_shard > 1:
                add("dp_shard", accum * (e_shard - 1) / e_shard * 8 * p["expert"] / (L.pp * L.ep))
        else:
            add("dp_shard", accum * frac * 8 * p["expert"] / L.pp)
    if L.dp_replicate > 1:  # DDP / HSDP: all-reduce (2 (r-1)/r) of the fp32 grad shard, every micro-batch
        r = L.dp_replicate
        add("dp_replicate", accum * 2 * (r - 1) / r * 4 * (ne_gpu + ex_gpu))
    act_bytes = 2 * m.hidden_size * tokens  # one (1, T/cp, h) bf16 activation
    n_moe = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    if L.tp > 1:  # SP: per block 2 all-gathers + 2 reduce-scatters forward, same backward, +forward if AC
        frac = (L.tp - 1) / L.tp
        ops = 3 * 4 * (m.num_layers - n_moe) + 3 * 2 * n_moe  # MoE blocks: attention's 2 only
        add("tp", accum * ops * frac * act_bytes / L.pp)
    if L.cp > 1:  # ring: cp-1 K/V blocks per layer forward, recompute, and their grads backward
        kv_bytes = 2 * 2 * m.num_kv_heads * m.head_dim * tokens / L.tp
        add("cp", accum * 3 * (L.cp - 1) * kv_bytes * m.num_layers / L.pp)
    if L.ep > 1:  # dispatch + combine forward, recompute, both backward: top_k copies of each token
        frac = (L.ep - 1) / L.ep
        add("ep", accum * 6 * frac * m.moe.top_k * act_bytes / L.tp * n_moe / L.pp)
    if L.pp > 1:  # activations forward, their grads backward, per microbatch at each stage boundary
        add("pp", accum * 2 * act_bytes / L.tp)
    # -- compute: 6 N_active + attention (causal: 6 T h_q per token per layer), x 4/3 for the recompute
    flops = global_batch * seq * (6 * p["active"] + 6 * m.num_layers * seq * m.num_heads * m.head_dim) * 4 / 3
    compute = flops / L.world / (PEAK_TFLOPS * 1e12 * MFU)
    comm = intra / (NVLINK_GBPS * GB) + inter / (IB_GBPS * GB)
    return Row(name, L.world, L.name(), state / GB, gathered / GB, act / GB, act_ckpt / GB,
               (state + gathered + act_ckpt) / GB + RESERVED_GB, intra / GB, inter / GB, comm, compute, accum)


def layouts_for(m: ModelArgs, gpus: int) -> list[Layout]:
    """The layouts worth comparing at `gpus` GPUs (tp and ep inside a node)."""
    out = [Layout(dp_shard=gpus), Layout(dp_replicate=gpus // 8, dp_shard=8)]
    for tp in (2, 4, 8):
        out.append(Layout(dp_shard=gpus // tp, tp=tp))
    out.append(Layout(dp_shard=gpus // 8, tp=4, pp=2))
    out.append(Layout(dp_shard=gpus // 4, cp=2, tp=2))
    if m.moe is not None:
        for ep in (2, 4, 8):
            out.append(Layout(dp_shard=gpus, ep=ep))
        out.append(Layout(dp_shard=gpus // 2, tp=2, ep=4))
        out.append(Layout(dp_replicate=gpus // 16, dp_shard=16, ep=8))
    return out


def recommend(rows: list[Row], mem_gb: float) -> Row | None:
    """Fits (with checkpointing) in 90% of memory; then the least exposed communication (comm
    beyond compute, if overlap were perfect), then the least communication (overlap is not
    perfect), then the fewest parallel dims."""
    fits = [r for r in rows if r.total_ckpt_gb <= 0.9 * mem_gb]
    return min(fits, key=lambda r: (round(max(0.0, r.comm_s - r.compute_s), 1), round(r.comm_s, 1),
                                    r.layout.count(" x ")), default=None)


def table(rows: list[Row], mem: dict[str, float]) -> str:
    head = ("| layout | state | gathered | act (no AC) | act (AC) | total (AC) | fits H100 / H200 | NVLink GB | IB GB "
            "| comm s | compute s |\n|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        fit = " / ".join("yes" if r.total_ckpt_gb <= 0.9 * g else "no" for g in mem.values())
        lines.append(f"| {r.layout} | {r.state_gb:.1f} | {r.gathered_gb:.1f} | {r.act_gb:.1f} | {r.act_ckpt_gb:.1f} "
                     f"| {r.total_ckpt_gb:.1f} | {fit} | {r.intra_gb:.0f} | {r.inter_gb:.0f} | {r.comm_s:.2f} "
                     f"| {r.compute_s:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=["llama-3.1-8b", "mixtral-8x7b"])
    ap.add_argument("--gpus", nargs="+", type=int, default=[64, 128, 256, 512])
    ap.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    ap.add_argument("--global-batch", type=int, default=512, help="sequences per optimizer step")
    ap.add_argument("--micro-batch", type=int, default=1, help="sequences per data-parallel rank per forward")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    mem = {k: v["mem_gb"] for k, v in GPUS.items()}
    report = []
    for name in a.model:
        m = get_preset(name)
        p = param_counts(m)
        if not a.json:
            print(f"\n### {name}: {p['total'] / 1e9:.2f}B parameters ({p['active'] / 1e9:.2f}B active), "
                  f"seq {a.seq}, {a.global_batch} sequences per step, micro-batch {a.micro_batch}\n")
        for gpus in a.gpus:
            # More data-parallel ranks than sequences would leave ranks idle: not a layout.
            rows = [estimate(name, m, L, a.seq, a.global_batch, a.micro_batch) for L in layouts_for(m, gpus)
                    if L.world == gpus and L.dp_replicate * L.dp_shard * a.micro_batch <= a.global_batch]
            best = {g: recommend(rows, v) for g, v in mem.items()}
            report.append(dict(model=name, gpus=gpus, rows=[asdict(r) for r in rows],
                               recommended={g: (b.layout if b else None) for g, b in best.items()}))
            if not a.json:
                print(f"#### {gpus} GPUs\n")
                print(table(rows, mem))
                print("\nrecommended: " + "; ".join(f"{g}: {b.layout if b else 'none fits'}" for g, b in best.items())
                      + "\n")
    if a.json:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
