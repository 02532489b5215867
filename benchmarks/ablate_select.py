"""Timing-only variants of the selection kernel (some give wrong ids by design): where its time goes.

    python benchmarks/ablate_select.py [S] [random|coherent]   (GPU; TRITON_INTERPRET=1: checks the gated variant)
"""
import importlib.util, json, sys, os
import torch, triton.testing
sys.path.insert(0, os.getcwd())
from openmsa.bench.selection import index_inputs
from openmsa.ops.layout import batch_cu_seqlens
src = open("openmsa/ops/select.py").read().replace("from .configs", "from openmsa.ops.configs") \
    .replace("from .quantize", "from openmsa.ops.quantize").replace("from .worklists", "from openmsa.ops.worklists")
KEY_SCALE = "    if QUANTIZED:\n        scores = scores * tl.load(ik_scale_base + key_pos * stride_iks_t)[None, :]\n"
assert KEY_SCALE in src
MERGE = "        keys = _merge_block(keys, pooled, block, forced)\n"
assert MERGE in src
LOOP = "    for block in range(0, own_block):  # blocks before the own block are fully visible\n"
assert LOOP in src
variants = {"full": src,
            "no_key_scale": src.replace(KEY_SCALE, ""),
            "no_merge": src.replace(MERGE, "        acc = tl.maximum(acc, pooled)\n").replace(
                LOOP, "    acc = tl.full((ROWS,), float('-inf'), tl.float32)\n" + LOOP).replace(
                "    # The own block: causal mask, always forced.\n",
                "    keys = _merge_block(keys, acc, 0, rows < 0)\n")}
variants["no_merge_no_key_scale"] = variants["no_merge"].replace(KEY_SCALE, "")
GATED = """        if forced | (tl.max((pooled > threshold).to(tl.int32), axis=0) > 0):
            keys = _merge_block(keys, pooled, block, forced)
            smallest = tl.min(keys, axis=1)
            bits = (smallest >> 32).to(tl.int32)
            threshold = tl.where(smallest < TOP_K - 0x7FFFFFFFFFFFFFFF, float("-inf"),
                                 _order_preserving_bits(bits).to(tl.float32, bitcast=True))
"""
variants["gated"] = src.replace(MERGE, GATED).replace(
    LOOP, "    threshold = tl.full((ROWS,), float('-inf'), tl.float32)\n" + LOOP)
os.makedirs(".scratch/variants", exist_ok=True)
mods = {}
for name, text in variants.items():
    path = f".scratch/variants/select_{name}.py"
    open(path, "w").write(text)
    spec = importlib.util.spec_from_file_location(f"select_{name}", path)
    mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod); mods[name] = mod
if os.environ.get("TRITON_INTERPRET") == "1":  # CPU check of the gated variant
    for precision in ("input", "fp8"):
        for seed in range(3):
            g = torch.Generator().manual_seed(seed)
            iq = torch.randn(700, 4, 64, generator=g); ik = torch.randn(700, 1, 64, generator=g)
            cu = torch.tensor([0, 300, 700], dtype=torch.int32)
            a, b = (mods[n].select_blocks_fwd(iq, ik, cu, top_k=4, block_size=64, index_softmax_scale=0.125,
                    num_local_blocks=1, num_sink_blocks=1, index_precision=precision) for n in ("full", "gated"))
            print(precision, seed, torch.equal(a.sort(-1).values, b.sort(-1).values))
    sys.exit()
S = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
g = torch.Generator(device="cuda").manual_seed(0)
KIND = sys.argv[2] if len(sys.argv) > 2 else "random"
iq, ik = index_inputs(KIND, S, 4, 128, g)
cu = batch_cu_seqlens(1, S, "cuda")
flops = 2 * 4 * 128 * S * (S + 1) / 2
out = []
for precision in ("input", "fp8"):
    for name, mod in mods.items():
        if precision == "input" and "key_scale" in name:
            continue
        for cfg in ([dict(tile_rows=r, num_warps=w, num_stages=st) for r, w, st in ((128, 8, 2), (128, 8, 3), (256, 8, 2), (128, 4, 2))]) \
                   if name in ("full", "gated") else [dict(tile_rows=128, num_warps=8, num_stages=2)]:
            fn = lambda: mod.select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=128 ** -0.5,
                                               num_local_blocks=1, num_sink_blocks=0, index_precision=precision, **cfg)
            try:
                ms = triton.testing.do_bench(fn, warmup=1, rep=20, return_mode="median")
            except Exception as e:
                print(precision, name, cfg, "failed", str(e)[:150]); continue
            row = dict(S=S, precision=precision, variant=name, **cfg, ms=ms, tflops=flops / ms / 1e9)
            if name == "gated":
                reference = mods["full"].select_blocks_fwd(iq, ik, cu, top_k=16, block_size=128, index_softmax_scale=128 ** -0.5,
                                               num_local_blocks=1, num_sink_blocks=0, index_precision=precision, **cfg)
                row["same_ids_as_full"] = bool(torch.equal(fn().sort(-1).values, reference.sort(-1).values))
            out.append(row); print(json.dumps(row), flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "ablate_select.json"), "w"), indent=1)
