"""Route bands on both sides of every boundary, from host-known metadata only (no GPU needed).

Each (family, rule, band key) of jit/routes/*.json must appear in EDGES below: a band added to a
routes file without its boundary cases here fails test_every_band_edge_is_covered."""
import json

import pytest

from flashkda_ext import dispatch, jit, validation
from flashkda_ext.paths import jit_dir


def decode_meta(**kw):
    m = {"device": "cuda", "rows": 1, "value_heads": 16, "work_items": 16, "state": "f32", "offset": "o32",
         "slot_mode": "unique", "gate": "softplus"}
    m.update(kw)
    m["work_items"] = m["rows"] * m["value_heads"]
    return m


CHUNK64 = frozenset({"chunk64"})  # FLASHKDA_EXT_OPT_IN=chunk64


def prefill_meta(**kw):
    """kda_prefill's route metadata as the op derives it (validation.prefill_route_meta) from these fields."""
    m = {"device": "cuda", "num_seqs": 1, "value_heads": 16, "total_tokens": 4096, "max_seqlen": None, "state": "f32",
         "offset": "o32", "gate": "softplus", "checkpoints": False}
    m.update(kw)
    lower_bound = m.pop("lower_bound", -5.0 if m["gate"] == "bounded" else None)
    return validation.prefill_route_meta(m["device"], m["num_seqs"], m["value_heads"], m["total_tokens"], m["max_seqlen"],
                                         m["state"], m["offset"], m["gate"], m["checkpoints"], lower_bound)


def like(num_seqs, value_heads, length, **kw):
    """A bounded-gate batch of like-length prompts whose longest the caller gives (max_seqlen)."""
    return prefill_meta(gate="bounded", num_seqs=num_seqs, value_heads=value_heads, total_tokens=num_seqs * length,
                        max_seqlen=length, **kw)


def verify_meta(**kw):
    m = {"device": "cuda", "num_seqs": 1, "value_heads": 16, "total_tokens": 2, "max_seqlen": 2, "work_items": 16,
         "state": "f32", "offset": "o32", "gate": "softplus"}
    m.update(kw)
    m["work_items"] = m["num_seqs"] * m["value_heads"]
    return m


# (family, rule name, band key): [(meta, expected module), ...] - the edge and one past it; an opt-in
# rule's cases carry the opted-in names as a third item
EXACT = frozenset({"exact_chain"})
SP_LONG = frozenset({"c16g_softplus_long"})
C16G_FULL = frozenset({"c16g_full"})   # a tag no rule opts in to any more (c16g_full is routed): changes nothing
EDGES = {
    ("kda_prefill", "long_pieces_vt64", "work_items_max"): [
        (prefill_meta(value_heads=8, total_tokens=8192), "prefill_pc8_vt64_f32"),                  # 8
        (prefill_meta(value_heads=9, total_tokens=8192), "prefill_pc16_vt64g2_f32"),               # 9
        (prefill_meta(value_heads=8, total_tokens=8192, state="bf16"), "prefill_pc8_vt64_bf16"),
        (prefill_meta(value_heads=8, total_tokens=8192, checkpoints=True), "prefill_vt16_f32"),
    ],
    ("kda_prefill", "long_pieces_vt64", "mean_seqlen_min"): [
        (prefill_meta(value_heads=8, total_tokens=8192), "prefill_pc8_vt64_f32"),
        (prefill_meta(value_heads=8, total_tokens=8191), "prefill_vt16_f32"),
        (prefill_meta(num_seqs=2, value_heads=4, total_tokens=16384), "prefill_pc8_vt64_f32"),   # mean 8192
        (prefill_meta(num_seqs=2, value_heads=4, total_tokens=16383), "prefill_vt16_f32"),       # mean 8191
    ],
    ("kda_prefill", "long_pieces_groups_32", "work_items_max"): [
        (prefill_meta(value_heads=32, total_tokens=16384), "prefill_pc16_vt64g2_f32"),             # 32
        (prefill_meta(value_heads=33, total_tokens=16384), "prefill_vt32_f32"),                    # 33
        (prefill_meta(value_heads=32, total_tokens=16384, checkpoints=True), "prefill_vt32_f32"),
    ],
    ("kda_prefill", "long_pieces_groups_32", "mean_seqlen_min"): [
        (prefill_meta(value_heads=25, total_tokens=16384), "prefill_pc16_vt64g2_f32"),
        (prefill_meta(value_heads=25, total_tokens=16383), "prefill_vt32_f32"),
        (prefill_meta(num_seqs=4, value_heads=8, total_tokens=4 * 8192), "prefill_vt32_f32"),     # 4x8192 H8: mean 8192
    ],
    ("kda_prefill", "long_pieces_groups", "work_items_max"): [
        (prefill_meta(value_heads=24, total_tokens=8192), "prefill_pc16_vt64g2_f32"),              # 24
        (prefill_meta(value_heads=25, total_tokens=8192), "prefill_vt32_f32"),                     # 25, mean 8192
        (prefill_meta(value_heads=24, total_tokens=8192, state="bf16"), "prefill_pc16_vt64g2_bf16"),
        (prefill_meta(value_heads=12, total_tokens=8192, state="bf16"), "prefill_pc16_vt64g2_bf16"),
        (prefill_meta(value_heads=16, total_tokens=8192), "prefill_pc16_vt64g2_f32"),              # 16
    ],
    ("kda_prefill", "long_pieces_groups", "mean_seqlen_min"): [
        (prefill_meta(value_heads=24, total_tokens=8192), "prefill_pc16_vt64g2_f32"),
        (prefill_meta(value_heads=24, total_tokens=8191), "prefill_vt32_f32"),
        (prefill_meta(value_heads=16, total_tokens=8191), "prefill_vt16_f32"),
        (prefill_meta(num_seqs=3, value_heads=4, total_tokens=3 * 8192), "prefill_pc16_vt64g2_f32"),  # 12 items
    ],
    ("kda_prefill", "long_exact_chain_24", "work_items_max"): [
        (prefill_meta(value_heads=24, total_tokens=8192), "prefill_vt32_f32", EXACT),
        (prefill_meta(value_heads=25, total_tokens=8192), "prefill_vt32_f32", EXACT),              # some_seq_heads
        (prefill_meta(value_heads=25, total_tokens=16384), "prefill_vt32_f32", EXACT),             # long_exact_chain_32
    ],
    ("kda_prefill", "long_exact_chain_24", "mean_seqlen_min"): [
        (prefill_meta(value_heads=20, total_tokens=8192, state="bf16"), "prefill_vt32_bf16", EXACT),
        (prefill_meta(value_heads=20, total_tokens=8191, state="bf16"), "prefill_vt32_bf16", EXACT),
    ],
    ("kda_prefill", "long_exact_chain_32", "work_items_max"): [
        (prefill_meta(value_heads=32, total_tokens=16384), "prefill_vt32_f32", EXACT),
        (prefill_meta(value_heads=33, total_tokens=16384), "prefill_vt32_f32", EXACT),
        (prefill_meta(value_heads=12, total_tokens=16384), "prefill_vt16_f32", EXACT),             # long_exact_chain
    ],
    ("kda_prefill", "long_exact_chain_32", "mean_seqlen_min"): [
        (prefill_meta(value_heads=25, total_tokens=16384), "prefill_vt32_f32", EXACT),
        (prefill_meta(value_heads=25, total_tokens=16383), "prefill_vt32_f32", EXACT),
    ],
    ("kda_prefill", "long_exact_chain", "work_items_max"): [
        (prefill_meta(value_heads=16, total_tokens=8192), "prefill_vt16_f32", EXACT),
        (prefill_meta(value_heads=17, total_tokens=8192), "prefill_vt32_f32", EXACT),
    ],
    # the unsplit module on both sides of the edge: exact_chain sends a call where the bands below would
    ("kda_prefill", "long_exact_chain", "mean_seqlen_min"): [
        (prefill_meta(value_heads=8, total_tokens=8192), "prefill_vt16_f32", EXACT),
        (prefill_meta(value_heads=8, total_tokens=8191), "prefill_vt16_f32", EXACT),
    ],
    # bf16 state: the same bands, the bf16 twins
    ("kda_prefill", "long_pieces_vt64", "work_items_max", "bf16"): [
        (prefill_meta(value_heads=8, total_tokens=8192, state="bf16"), "prefill_pc8_vt64_bf16"),            # 8
        (prefill_meta(value_heads=9, total_tokens=8192, state="bf16"), "prefill_pc16_vt64g2_bf16"),         # 9
        (prefill_meta(value_heads=8, total_tokens=8192, state="bf16", checkpoints=True), "prefill_vt16_bf16"),
        (prefill_meta(value_heads=8, total_tokens=8192, state="bf16"), "prefill_vt16_bf16", EXACT),
    ],
    ("kda_prefill", "long_pieces_groups_32", "work_items_max", "bf16"): [
        (prefill_meta(value_heads=32, total_tokens=16384, state="bf16"), "prefill_pc16_vt64g2_bf16"),       # 32
        (prefill_meta(value_heads=33, total_tokens=16384, state="bf16"), "prefill_vt32_bf16"),              # 33
        (prefill_meta(value_heads=24, total_tokens=16384, state="bf16"), "prefill_vt32_bf16", EXACT),
    ],
    ("kda_decode", "bf16_large", "work_items_min"): [
        (decode_meta(rows=1024, value_heads=8, state="bf16"), "decode_rowtma_bf16_o32"),    # 8192
        (decode_meta(rows=1023, value_heads=8, state="bf16"), "decode_quartmabulk_bf16_o32"),  # 8184
        (decode_meta(rows=4096, value_heads=64, state="bf16", offset="o64"), "decode_rowtma_bf16_o64"),
        (decode_meta(rows=1023, value_heads=8), "decode_halftma_f32_o32"),                  # fp32: f32_large from 3072
    ],
    ("kda_decode", "bf16_tiles_bulk", "work_items_min"): [
        (decode_meta(rows=64, value_heads=8, state="bf16"), "decode_quartmabulk_bf16_o32"),  # 512
        (decode_meta(rows=511, value_heads=1, state="bf16"), "decode_quartma_bf16_o32"),     # 511
        (decode_meta(rows=8, value_heads=64, state="bf16", offset="o64"), "decode_quartmabulk_bf16_o64"),
        (decode_meta(rows=32, value_heads=16), "decode_split8_f32_o32"),                    # fp32: not this band
    ],
    ("kda_decode", "bf16_tiles", "work_items_min"): [
        (decode_meta(rows=4, value_heads=8, state="bf16"), "decode_quartma_bf16_o32"),      # 32
        (decode_meta(rows=31, value_heads=1, state="bf16"), "decode_split8_bf16_o32"),      # 31: bf16_tiny
        (decode_meta(rows=1, value_heads=16, state="bf16", offset="o64"), "decode_split8_bf16_o64"),
        (decode_meta(rows=4, value_heads=8), "decode_quartma_f32_o32"),                     # fp32: tiny
    ],
    ("kda_decode", "f32_large", "work_items_min"): [
        (decode_meta(rows=256, value_heads=12), "decode_halftma_f32_o32"),     # 3072
        (decode_meta(rows=255, value_heads=12), "decode_split8_f32_o32"),      # 3060: fallback
        (decode_meta(rows=384, value_heads=8), "decode_halftma_f32_o32"),      # 3072 with 8 heads: before hv8_row
        (decode_meta(rows=383, value_heads=8), "decode_row_f32_o32"),          # 3064: hv8_row
        (decode_meta(rows=128, value_heads=64, offset="o64"), "decode_halftma_f32_o64"),
    ],
    ("kda_decode", "tiny", "work_items_max"): [
        (decode_meta(rows=8, value_heads=16), "decode_quartma_f32_o32"),       # 128 work items
        (decode_meta(rows=129, value_heads=1), "decode_split8_f32_o32"),       # 129: fallback
        (decode_meta(rows=16, value_heads=8), "decode_quartma_f32_o32"),       # 128 with 8 heads: tiny wins
        (decode_meta(rows=2, value_heads=64, offset="o64"), "decode_quartma_f32_o64"),
    ],
    ("kda_decode", "hv8_row", "work_items_min"): [
        (decode_meta(rows=32, value_heads=8), "decode_row_f32_o32"),           # 256
        (decode_meta(rows=31, value_heads=8), "decode_split8_f32_o32"),        # 248
        (decode_meta(rows=32, value_heads=8, state="bf16"), "decode_quartma_bf16_o32"),   # bf16 band
        (decode_meta(rows=16, value_heads=16), "decode_split8_f32_o32"),       # 256 but 16 heads
        (decode_meta(rows=383, value_heads=8, offset="o64"), "decode_row_f32_o64"),
    ],
    # fp32 g / beta (gb = "f32"): the _gb32 twin of each band, at the same edges
    ("kda_decode", "bf16_large_gb32", "work_items_min"): [
        (decode_meta(rows=1024, value_heads=8, state="bf16", gb="f32"), "decode_rowtma_bf16_o32_gb32"),
        (decode_meta(rows=1023, value_heads=8, state="bf16", gb="f32"), "decode_quartmabulk_bf16_o32_gb32"),
        (decode_meta(rows=4096, value_heads=64, state="bf16", offset="o64", gb="f32"), "decode_rowtma_bf16_o64_gb32"),
        (decode_meta(rows=1024, value_heads=8, state="bf16", gb="input"), "decode_rowtma_bf16_o32"),
    ],
    ("kda_decode", "bf16_tiles_bulk_gb32", "work_items_min"): [
        (decode_meta(rows=64, value_heads=8, state="bf16", gb="f32"), "decode_quartmabulk_bf16_o32_gb32"),
        (decode_meta(rows=511, value_heads=1, state="bf16", gb="f32"), "decode_quartma_bf16_o32_gb32"),
        (decode_meta(rows=8, value_heads=64, state="bf16", offset="o64", gb="f32"), "decode_quartmabulk_bf16_o64_gb32"),
    ],
    ("kda_decode", "bf16_tiles_gb32", "work_items_min"): [
        (decode_meta(rows=4, value_heads=8, state="bf16", gb="f32"), "decode_quartma_bf16_o32_gb32"),
        (decode_meta(rows=31, value_heads=1, state="bf16", gb="f32"), "decode_split8_bf16_o32_gb32"),
        (decode_meta(rows=1, value_heads=16, state="bf16", offset="o64", gb="f32"), "decode_split8_bf16_o64_gb32"),
    ],
    ("kda_decode", "f32_large_gb32", "work_items_min"): [
        (decode_meta(rows=256, value_heads=12, gb="f32"), "decode_halftma_f32_o32_gb32"),
        (decode_meta(rows=255, value_heads=12, gb="f32"), "decode_split8_f32_o32_gb32"),
        (decode_meta(rows=384, value_heads=8, gb="f32"), "decode_halftma_f32_o32_gb32"),
        (decode_meta(rows=383, value_heads=8, gb="f32"), "decode_row_f32_o32_gb32"),
        (decode_meta(rows=128, value_heads=64, offset="o64", gb="f32"), "decode_halftma_f32_o64_gb32"),
    ],
    ("kda_decode", "tiny_gb32", "work_items_max"): [
        (decode_meta(rows=8, value_heads=16, gb="f32"), "decode_quartma_f32_o32_gb32"),
        (decode_meta(rows=129, value_heads=1, gb="f32"), "decode_split8_f32_o32_gb32"),
        (decode_meta(rows=2, value_heads=64, offset="o64", gb="f32"), "decode_quartma_f32_o64_gb32"),
    ],
    ("kda_decode", "hv8_row_gb32", "work_items_min"): [
        (decode_meta(rows=32, value_heads=8, gb="f32"), "decode_row_f32_o32_gb32"),
        (decode_meta(rows=31, value_heads=8, gb="f32"), "decode_split8_f32_o32_gb32"),
        (decode_meta(rows=383, value_heads=8, offset="o64", gb="f32"), "decode_row_f32_o64_gb32"),
    ],
    ("fused_kda_decode", "tiny", "work_items_max"): [
        (decode_meta(rows=2, value_heads=16), "fused_quad_f32_o32"),           # 32
        (decode_meta(rows=33, value_heads=1), "fused_rowtmalate_f32_o32"),     # 33
        (decode_meta(rows=3, value_heads=16, state="bf16"), "fused_rowtmalate512_bf16_o32"),  # 48
    ],
    ("fused_kda_decode", "bf16_small", "work_items_max"): [
        (decode_meta(rows=8, value_heads=16, state="bf16"), "fused_rowtmalate512_bf16_o32"),  # 128
        (decode_meta(rows=129, value_heads=1, state="bf16"), "fused_rowtmalate_bf16_o32"),    # 129
        (decode_meta(rows=1, value_heads=64, state="bf16", offset="o64"), "fused_rowtmalate512_bf16_o64"),
        (decode_meta(rows=2, value_heads=16, state="bf16"), "fused_quad_bf16_o32"),           # 32: tiny first
        (decode_meta(rows=8, value_heads=16), "fused_rowtmalate_f32_o32"),                    # fp32: small_f32
    ],
    ("fused_kda_decode", "small_f32", "work_items_max"): [
        (decode_meta(rows=64, value_heads=16), "fused_rowtmalate_f32_o32"),    # 1024
        (decode_meta(rows=1025, value_heads=1), "fused_rowtma_f32_o32"),       # 1025: fallback
        (decode_meta(rows=4096, value_heads=64, state="bf16", offset="o64"), "fused_rowtmabulk_bf16_o64"),
    ],
    ("fused_kda_decode", "bf16_bulk", "work_items_min"): [
        (decode_meta(rows=64, value_heads=16, state="bf16"), "fused_rowtmabulk_bf16_o32"),   # 1024
        (decode_meta(rows=1023, value_heads=1, state="bf16"), "fused_rowtmalate_bf16_o32"),  # 1023
        (decode_meta(rows=16, value_heads=64, state="bf16", offset="o64"), "fused_rowtmabulk_bf16_o64"),
        (decode_meta(rows=1024, value_heads=1), "fused_rowtmalate_f32_o32"),                 # fp32: small_f32
    ],
    ("kda_prefill", "few_seq_heads", "work_items_max"): [
        (prefill_meta(num_seqs=1, value_heads=16), "prefill_vt16_f32"),        # 16
        (prefill_meta(num_seqs=17, value_heads=1), "prefill_vt32_f32"),        # 17
    ],
    ("kda_prefill", "many_seq_heads", "work_items_min"): [
        (prefill_meta(num_seqs=16, value_heads=16), "prefill_vt64s_f32"),       # 256
        (prefill_meta(num_seqs=255, value_heads=1), "prefill_vt64_f32"),        # 255
        (prefill_meta(num_seqs=256, value_heads=1, state="bf16"), "prefill_vt64s_bf16"),
    ],
    ("kda_verify", "few_items_short", "work_items_max"): [
        (verify_meta(num_seqs=1, value_heads=16), "verify_stage16w4g_f32_o32"),             # 16, T 2
        (verify_meta(num_seqs=16, value_heads=1, state="bf16", offset="o64"), "verify_stage16w4g_bf16_o64"),
        (verify_meta(num_seqs=17, value_heads=1), "verify_bulk4j4g_f32_o32"),                # 17: small_short
    ],
    ("kda_verify", "few_items_short", "max_seqlen_max"): [
        (verify_meta(num_seqs=1, value_heads=16, max_seqlen=2), "verify_stage16w4g_f32_o32"),
        (verify_meta(num_seqs=1, value_heads=16, max_seqlen=3), "verify_stage16w4_f32_o32"),  # T 3: few_items
    ],
    ("kda_verify", "few_items", "work_items_max"): [
        (verify_meta(num_seqs=1, value_heads=16, max_seqlen=8), "verify_stage16w4_f32_o32"),  # 16
        (verify_meta(num_seqs=16, value_heads=1, max_seqlen=4, state="bf16", offset="o64"), "verify_stage16w4_bf16_o64"),
        (verify_meta(num_seqs=17, value_heads=1, max_seqlen=8), "verify_bulk4j4_f32_o32"),    # 17: fallback
        (verify_meta(num_seqs=17, value_heads=1, max_seqlen=8, state="bf16"), "verify_bulk4j4_bf16_o32"),
    ],
    ("kda_verify", "small_short", "work_items_min"): [
        (verify_meta(num_seqs=17, value_heads=1, max_seqlen=4), "verify_bulk4j4g_f32_o32"),   # 17
        (verify_meta(num_seqs=16, value_heads=1, max_seqlen=4), "verify_stage16w4_f32_o32"),  # 16: few_items
    ],
    ("kda_verify", "small_short", "work_items_max"): [
        (verify_meta(num_seqs=4, value_heads=16, state="bf16"), "verify_bulk4j4g_bf16_o32"),  # 64
        (verify_meta(num_seqs=65, value_heads=1, max_seqlen=8), "verify_bulk4j4_f32_o32"),    # 65, T 8: fallback
        (verify_meta(num_seqs=65, value_heads=1, state="bf16"), "verify_stage2j8_bf16_o32"),  # 65: bf16_large
    ],
    ("kda_verify", "f32_mid_low", "work_items_min"): [
        (verify_meta(num_seqs=4, value_heads=12, max_seqlen=4), "verify_w2v16j4_f32_o32"),    # 48
        (verify_meta(num_seqs=47, value_heads=1, max_seqlen=4), "verify_bulk4j4g_f32_o32"),   # 47: small_short
    ],
    ("kda_verify", "f32_mid_low", "work_items_max"): [
        (verify_meta(num_seqs=64, value_heads=1, max_seqlen=3), "verify_w2v16j4_f32_o32"),    # 64
        (verify_meta(num_seqs=4, value_heads=16, max_seqlen=3, state="bf16"), "verify_bulk4j4g_bf16_o32"),  # fp32 only
    ],
    ("kda_verify", "f32_mid_low", "max_seqlen_min"): [
        (verify_meta(num_seqs=4, value_heads=12, max_seqlen=3), "verify_w2v16j4_f32_o32"),
        (verify_meta(num_seqs=4, value_heads=12, max_seqlen=2), "verify_bulk4j4g_f32_o32"),   # T 2: small_short
    ],
    ("kda_verify", "f32_mid_low", "max_seqlen_max"): [
        (verify_meta(num_seqs=4, value_heads=16, max_seqlen=4, offset="o64"), "verify_w2v16j4_f32_o64"),
        (verify_meta(num_seqs=4, value_heads=16, max_seqlen=5), "verify_bulk4j4_f32_o32"),    # T 5: fallback
    ],
    ("kda_verify", "f32_mid", "work_items_min"): [
        (verify_meta(num_seqs=65, value_heads=1, max_seqlen=2), "verify_w2v16j4_f32_o32"),    # 65
        (verify_meta(num_seqs=64, value_heads=1, max_seqlen=2), "verify_bulk4j4g_f32_o32"),   # 64, T 2: small_short
    ],
    ("kda_verify", "f32_mid", "work_items_max"): [
        (verify_meta(num_seqs=4, value_heads=32, max_seqlen=4), "verify_w2v16j4_f32_o32"),    # 128
        (verify_meta(num_seqs=129, value_heads=1, max_seqlen=4), "verify_w1v16j4s_f32_o32"),   # 129: f32_192
        (verify_meta(num_seqs=4, value_heads=32, max_seqlen=4, state="bf16"), "verify_stage2j8_bf16_o32"),
    ],
    ("kda_verify", "f32_mid", "max_seqlen_max"): [
        (verify_meta(num_seqs=4, value_heads=24, max_seqlen=4), "verify_w2v16j4_f32_o32"),
        (verify_meta(num_seqs=4, value_heads=24, max_seqlen=5), "verify_bulk4j4_f32_o32"),    # T 5: fallback
    ],
    ("kda_verify", "f32_192", "work_items_min"): [
        (verify_meta(num_seqs=129, value_heads=1, max_seqlen=2), "verify_w1v16j4s_f32_o32"),   # 129
    ],
    ("kda_verify", "f32_192", "work_items_max"): [
        (verify_meta(num_seqs=16, value_heads=12, max_seqlen=4, offset="o64"), "verify_w1v16j4s_f32_o64"),  # 192
        (verify_meta(num_seqs=193, value_heads=1, max_seqlen=4), "verify_bulk4j4_f32_o32"),   # 193: fallback
        (verify_meta(num_seqs=16, value_heads=12, max_seqlen=4, state="bf16"), "verify_stage2j8_bf16_o32"),
    ],
    ("kda_verify", "f32_192", "max_seqlen_max"): [
        (verify_meta(num_seqs=16, value_heads=12, max_seqlen=4), "verify_w1v16j4s_f32_o32"),
        (verify_meta(num_seqs=16, value_heads=12, max_seqlen=8), "verify_bulk4j4_f32_o32"),   # T 8: fallback
    ],
    ("kda_verify", "small_short", "max_seqlen_max"): [
        (verify_meta(num_seqs=2, value_heads=16, max_seqlen=4, offset="o64"), "verify_bulk4j4g_f32_o64"),
        (verify_meta(num_seqs=2, value_heads=16, max_seqlen=5), "verify_bulk4j4_f32_o32"),    # T 5: fallback
    ],
    ("kda_verify", "bf16_large", "work_items_min"): [
        (verify_meta(num_seqs=65, value_heads=1, state="bf16", max_seqlen=8), "verify_stage2j8_bf16_o32"),  # 65
        (verify_meta(num_seqs=4, value_heads=16, state="bf16", max_seqlen=8), "verify_bulk4j4_bf16_o32"),  # 64
        (verify_meta(num_seqs=1024, value_heads=64, max_seqlen=8, state="bf16", offset="o64"),
         "verify_stage2j8_bf16_o64"),
        (verify_meta(num_seqs=1024, value_heads=64, max_seqlen=8), "verify_bulk4j4_f32_o32"),  # fp32: fallback
    ],
    ("kda_prefill", "some_seq_heads", "work_items_max"): [
        (prefill_meta(num_seqs=5, value_heads=8), "prefill_vt32_f32"),         # 40
        (prefill_meta(num_seqs=41, value_heads=1), "prefill_vt64_f32"),        # 41
        (prefill_meta(num_seqs=41, value_heads=1, state="bf16"), "prefill_vt64_bf16"),
    ],
    # the fused 16-token-chunk kernel: bounded gate with lower_bound >= -5, >= 384 sequences x heads, <= 2048 tokens a
    # sequence on average
    ("kda_prefill", "fused_chunk16", "work_items_min"): [
        (prefill_meta(num_seqs=24, value_heads=16, total_tokens=24 * 512, gate="bounded"), "prefill_c16ws_f32"),       # 384
        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 512, max_seqlen=1024, gate="bounded"),
         "prefill_c16ws_f32"),    # 383 items, the longest 2x the mean, work_per_longest 191: fused_chunk16_wave
        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 512, max_seqlen=2000, gate="bounded"),
         "prefill_c16gm_vt64_f32"),    # work_per_longest 98: c16g_mixed_many
        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 512, max_seqlen=2000, gate="bounded"),
         "prefill_vt64s_f32", CHUNK64),    # its opt-out

        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 512, max_seqlen=512, gate="bounded"),
         "prefill_c16ws_f32"),      # fused_chunk16_wave (its longest known)
        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 512, gate="bounded"), "prefill_vt64s_f32"),
        (prefill_meta(num_seqs=24, value_heads=16, total_tokens=24 * 512, gate="bounded", state="bf16"), "prefill_c16ws_bf16"),
    ],
    ("kda_prefill", "fused_chunk16", "mean_seqlen_max"): [
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=32 * 2048, gate="bounded"), "prefill_c16ws_f32"),      # 2048
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=32 * 2049, gate="bounded"), "prefill_c16ws_f32"),  # fused_chunk16_long
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=32 * 2049, gate="bounded"), "prefill_vt64s_f32", CHUNK64),
    ],
    # a known longest sequence: the call's token-heads >= 100 times its length (14336 * 12 // 1720 = 100); an
    # unknown one counts as the mean (work_per_longest = work_items)
    ("kda_prefill", "fused_chunk16", "work_per_longest_min"): [
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=14336, max_seqlen=1720, gate="bounded"), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=14336, max_seqlen=1721, gate="bounded"),
         "prefill_vt64s_f32"),
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=14336, gate="bounded"), "prefill_c16ws_f32"),
    ],
    ("kda_prefill", "fused_chunk16", "lower_bound_min"): [
        (prefill_meta(num_seqs=64, value_heads=8, total_tokens=64 * 512, gate="bounded", lower_bound=-5.0), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=64, value_heads=8, total_tokens=64 * 512, gate="bounded", lower_bound=-5.01),
         "prefill_vt64s_f32"),
        (prefill_meta(num_seqs=64, value_heads=8, total_tokens=64 * 512), "prefill_c16ws_f32"),    # softplus: the next rule
    ],
    # the softplus and log gates in the same band (prefill_c16ws_*'s checked kernels, bitwise prefill_c16's)
    ("kda_prefill", "fused_chunk16_decay", "work_items_min"): [
        (prefill_meta(num_seqs=24, value_heads=16, total_tokens=24 * 512), "prefill_c16ws_f32"),                       # 384
        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 512, gate="log"), "prefill_vt64s_f32"),         # 383
        (prefill_meta(num_seqs=24, value_heads=16, total_tokens=24 * 512, gate="log", state="bf16"), "prefill_c16ws_bf16"),
    ],
    ("kda_prefill", "fused_chunk16_decay", "mean_seqlen_max"): [
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=32 * 2048, gate="log"), "prefill_c16ws_f32"),          # 2048
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=32 * 2049), "prefill_c16ws_f32"),   # 2049: _long_decay
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=32 * 2049, max_seqlen=7900), "prefill_vt64s_f32"),  # 99
    ],
    ("kda_prefill", "fused_chunk16_decay", "work_per_longest_min"): [
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=14336, max_seqlen=1720), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=32, value_heads=12, total_tokens=14336, max_seqlen=1721, gate="log"), "prefill_vt64s_f32"),
    ],
    # opt-in chunk64: the chunk-64 module wherever the fused rules would take prefill_c16
    ("kda_prefill", "chunk64", "work_items_min"): [
        (prefill_meta(num_seqs=24, value_heads=16, total_tokens=24 * 512), "prefill_vt64s_f32", frozenset({"chunk64"})),
        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 512, gate="bounded", lower_bound=-5.0),
         "prefill_vt64s_f32", frozenset({"chunk64"})),
        (prefill_meta(num_seqs=24, value_heads=16, total_tokens=24 * 512, gate="bounded", lower_bound=-5.0, state="bf16"),
         "prefill_vt64s_bf16", frozenset({"chunk64"})),
    ],
    # c16g (bounded gates): the guarded piece split where long_pieces_vt64, long_pieces_groups(_32), some_seq_heads and
    # fallback serve; up to 8 items it hands over to the chunk-64 piece split, guarded in turn by the unsplit chain
    # (c16g2), to 32 items to the unsplit chain (vt16 to 16 items, vt32 above), from 41 to fallback's kernels. Below 8192
    # tokens a sequence at <= 16 items the chunk-64 routes keep the call.
    ("kda_prefill", "c16g_few", "work_items_max"): [
        (prefill_meta(gate="bounded", value_heads=8, total_tokens=32768), "prefill_c16g2_pc8_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=2, value_heads=4, total_tokens=2 * 8192, state="bf16"),
         "prefill_c16g2_pc8_vt64_bf16"),
        (prefill_meta(gate="bounded", value_heads=8, total_tokens=32768), "prefill_vt16_f32", EXACT),   # the chain alone
        (prefill_meta(gate="bounded", value_heads=9, total_tokens=32768), "prefill_c16g_vt16_f32"),   # c16g_groups
        (prefill_meta(gate="bounded", value_heads=9, total_tokens=32768), "prefill_pc16_vt64g2_f32", CHUNK64),
    ],
    ("kda_prefill", "c16g_few", "mean_seqlen_min"): [
        (prefill_meta(gate="bounded", value_heads=8, total_tokens=8192), "prefill_c16g2_pc8_vt64_f32"),
        (prefill_meta(gate="bounded", value_heads=8, total_tokens=8191), "prefill_vt16_f32"),   # few_seq_heads
        (prefill_meta(gate="bounded", value_heads=8, total_tokens=8192), "prefill_pc8_vt64_f32", CHUNK64),   # chunk64: the band's module before c16g
    ],
    ("kda_prefill", "c16g_groups", "work_items_min"): [
        (prefill_meta(gate="bounded", value_heads=9, total_tokens=8192), "prefill_c16g_vt16_f32"),
        (prefill_meta(gate="bounded", value_heads=9, total_tokens=8192), "prefill_pc16_vt64g2_f32", CHUNK64),
        (prefill_meta(gate="bounded", value_heads=8, total_tokens=8192), "prefill_pc8_vt64_f32", CHUNK64),   # c16g_few's twin
    ],
    ("kda_prefill", "c16g_groups", "work_items_max"): [
        (prefill_meta(gate="bounded", value_heads=16, total_tokens=8192, state="bf16"), "prefill_c16g_vt16_bf16"),
        (prefill_meta(gate="bounded", value_heads=17, total_tokens=8192), "prefill_c16g_vt32_f32"),   # c16g_groups_24
    ],
    ("kda_prefill", "c16g_groups", "mean_seqlen_min"): [
        (prefill_meta(gate="bounded", value_heads=16, total_tokens=8192), "prefill_c16g_vt16_f32"),
        (prefill_meta(gate="bounded", value_heads=16, total_tokens=8191), "prefill_vt16_f32"),   # few_seq_heads
        (prefill_meta(gate="bounded", value_heads=16, total_tokens=8192), "prefill_pc16_vt64g2_f32", CHUNK64),   # chunk64: the band's module before c16g
    ],
    ("kda_prefill", "c16g_groups_24", "work_items_min"): [
        (prefill_meta(gate="bounded", value_heads=17, total_tokens=8192), "prefill_c16g_vt32_f32"),
        (prefill_meta(gate="bounded", value_heads=17, total_tokens=8192), "prefill_pc16_vt64g2_f32", CHUNK64),
        (prefill_meta(gate="bounded", value_heads=16, total_tokens=8192), "prefill_c16g_vt16_f32"),   # c16g_groups
    ],
    ("kda_prefill", "c16g_groups_24", "work_items_max"): [
        (prefill_meta(gate="bounded", value_heads=24, total_tokens=8192, state="bf16"), "prefill_c16g_vt32_bf16"),
        (prefill_meta(gate="bounded", value_heads=24, total_tokens=8192), "prefill_pc16_vt64g2_f32", CHUNK64),
        (prefill_meta(gate="bounded", value_heads=25, total_tokens=8192), "prefill_vt32_f32", CHUNK64),   # c16g_some's twin
    ],
    ("kda_prefill", "c16g_groups_24", "mean_seqlen_min"): [
        (prefill_meta(gate="bounded", value_heads=24, total_tokens=8192), "prefill_pc16_vt64g2_f32", CHUNK64),
        (prefill_meta(gate="bounded", value_heads=24, total_tokens=8191), "prefill_vt32_f32", CHUNK64),   # c16g_some's twin
    ],
    ("kda_prefill", "c16g_groups_32", "work_items_min"): [
        (prefill_meta(gate="bounded", value_heads=25, total_tokens=16384), "prefill_c16g_vt32_f32"),
        (prefill_meta(gate="bounded", value_heads=25, total_tokens=16384), "prefill_pc16_vt64g2_f32", CHUNK64),
        (prefill_meta(gate="bounded", value_heads=24, total_tokens=16384, state="bf16"), "prefill_c16g_vt32_bf16"),
    ],
    ("kda_prefill", "c16g_groups_32", "work_items_max"): [
        (prefill_meta(gate="bounded", value_heads=32, total_tokens=16384), "prefill_pc16_vt64g2_f32", CHUNK64),
        (prefill_meta(gate="bounded", value_heads=33, total_tokens=16384), "prefill_vt32_f32", CHUNK64),   # c16g_some's twin
    ],
    ("kda_prefill", "c16g_groups_32", "mean_seqlen_min"): [
        (prefill_meta(gate="bounded", value_heads=32, total_tokens=16384), "prefill_pc16_vt64g2_f32", CHUNK64),
        (prefill_meta(gate="bounded", value_heads=32, total_tokens=16383), "prefill_vt32_f32", CHUNK64),
    ],
    ("kda_prefill", "c16g_some", "work_items_min"): [
        (prefill_meta(gate="bounded", value_heads=17, total_tokens=4096), "prefill_c16g_vt32_f32"),
        (prefill_meta(gate="bounded", value_heads=16, total_tokens=4096), "prefill_vt16_f32"),   # few_seq_heads
    ],
    ("kda_prefill", "c16g_some", "work_items_max"): [
        (prefill_meta(gate="bounded", value_heads=40, total_tokens=4096, state="bf16"), "prefill_c16g_vt32_bf16"),
        (prefill_meta(gate="bounded", value_heads=41, total_tokens=4096), "prefill_c16g_vt64_f32"),
    ],
    ("kda_prefill", "c16g_some", "mean_seqlen_min"): [
        (prefill_meta(gate="bounded", value_heads=32, total_tokens=2048), "prefill_c16g_vt32_f32"),
        (prefill_meta(gate="bounded", value_heads=32, total_tokens=2047), "prefill_vt32_f32"),
    ],
    ("kda_prefill", "c16g_wide", "work_items_min"): [
        (prefill_meta(gate="bounded", value_heads=41, total_tokens=4096), "prefill_c16g_vt64_f32"),
        (prefill_meta(gate="bounded", value_heads=40, total_tokens=4096), "prefill_c16g_vt32_f32"),
    ],
    ("kda_prefill", "c16g_wide", "work_items_max"): [
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=33, total_tokens=4 * 4096, state="bf16"), "prefill_c16g_vt64_bf16"),
        (prefill_meta(gate="bounded", num_seqs=7, value_heads=19, total_tokens=7 * 4096), "prefill_c16g_c16_f32"),  # c16g_full
        (prefill_meta(gate="bounded", num_seqs=256, value_heads=1, total_tokens=256 * 4096), "prefill_c16ws_f32"),  # fused_chunk16_long
        (prefill_meta(gate="bounded", num_seqs=256, value_heads=1, total_tokens=256 * 4096), "prefill_vt64s_f32", CHUNK64),
    ],
    # c16g_softplus_long (opt-in): softplus gate, <= 24 items of >= 131072 tokens on average; the guarded fused split
    ("kda_prefill", "c16g_softplus_long", "work_items_max"): [
        (prefill_meta(value_heads=24, total_tokens=131072), "prefill_c16g_pc16_vt64g2_f32", SP_LONG),
        (prefill_meta(value_heads=25, total_tokens=131072), "prefill_pc16_vt64g2_f32", SP_LONG),   # long_pieces_groups_32
        (prefill_meta(value_heads=16, total_tokens=1 << 20, state="bf16"), "prefill_c16g_pc16_vt64g2_bf16", SP_LONG),
        (prefill_meta(value_heads=16, total_tokens=(1 << 20) - 16), "prefill_pc16_vt64g2_f32"),       # not opted in
        (prefill_meta(value_heads=16, total_tokens=1 << 20), "prefill_c16g_pc16_vt64g2_f32"),       # c16g_softplus_1m
        (prefill_meta(value_heads=8, total_tokens=1 << 20), "prefill_pc8_vt64_f32"),                # not opted in
        (prefill_meta(value_heads=16, total_tokens=1 << 20, gate="bounded"), "prefill_c16g_vt16_f32", SP_LONG),
        (prefill_meta(value_heads=16, total_tokens=1 << 20, checkpoints=True), "prefill_vt16_f32", SP_LONG),
    ],
    ("kda_prefill", "c16g_softplus_long", "mean_seqlen_min"): [
        (prefill_meta(value_heads=8, total_tokens=131072), "prefill_c16g_pc16_vt64g2_f32", SP_LONG),
        (prefill_meta(value_heads=8, total_tokens=131071), "prefill_pc8_vt64_f32", SP_LONG),        # long_pieces_vt64
        (prefill_meta(num_seqs=2, value_heads=4, total_tokens=2 * 131072), "prefill_c16g_pc16_vt64g2_f32", SP_LONG),
        (prefill_meta(num_seqs=2, value_heads=4, total_tokens=2 * 131072 - 1), "prefill_pc8_vt64_f32", SP_LONG),
    ],
    # c16g_softplus_1m: softplus gate, 9..24 items of >= 1M tokens on average; the same guarded fused split by default
    ("kda_prefill", "c16g_softplus_1m", "work_items_min"): [
        (prefill_meta(value_heads=9, total_tokens=1 << 20), "prefill_c16g_pc16_vt64g2_f32"),
        (prefill_meta(value_heads=8, total_tokens=1 << 20), "prefill_pc8_vt64_f32"),                # long_pieces_vt64
        (prefill_meta(num_seqs=3, value_heads=3, total_tokens=3 << 20, state="bf16"), "prefill_c16g_pc16_vt64g2_bf16"),
        (prefill_meta(value_heads=9, total_tokens=1 << 20), "prefill_pc16_vt64g2_f32", CHUNK64),    # its opt-out
    ],
    ("kda_prefill", "c16g_softplus_1m", "work_items_max"): [
        (prefill_meta(value_heads=24, total_tokens=1 << 20), "prefill_c16g_pc16_vt64g2_f32"),
        (prefill_meta(value_heads=25, total_tokens=1 << 20), "prefill_pc16_vt64g2_f32"),            # long_pieces_groups_32
        (prefill_meta(value_heads=24, total_tokens=1 << 20, gate="bounded"), "prefill_c16g_vt32_f32"),  # c16g_groups_24
        (prefill_meta(value_heads=24, total_tokens=1 << 20, checkpoints=True), "prefill_vt32_f32"),  # some_seq_heads
    ],
    ("kda_prefill", "c16g_softplus_1m", "mean_seqlen_min"): [
        (prefill_meta(num_seqs=2, value_heads=8, total_tokens=2 << 20), "prefill_c16g_pc16_vt64g2_f32"),
        (prefill_meta(num_seqs=2, value_heads=8, total_tokens=(2 << 20) - 1), "prefill_pc16_vt64g2_f32"),
        (prefill_meta(value_heads=12, total_tokens=(1 << 20) - 1, gate="log"), "prefill_pc16_vt64g2_f32"),
    ],
    # c16g_full (opt-in c16g_full): from 133 items (one wave of 2 CTAs an SM holds them at 132 SMs) the split over
    # several waves, its fallback the fused kernel unsplit
    ("kda_prefill", "c16g_full", "work_items_min"): [
        (prefill_meta(gate="bounded", num_seqs=1, value_heads=133, total_tokens=4096, state="bf16"), "prefill_c16g_c16_bf16",
         C16G_FULL),
        (prefill_meta(gate="bounded", num_seqs=1, value_heads=132, total_tokens=4096), "prefill_c16g_vt64_f32"),  # c16g_wide
        (prefill_meta(gate="bounded", num_seqs=1, value_heads=133, total_tokens=4096), "prefill_vt64_f32", CHUNK64 | C16G_FULL),
    ],
    ("kda_prefill", "c16g_full", "work_items_max"): [
        (prefill_meta(gate="bounded", num_seqs=5, value_heads=51, total_tokens=5 * 4096, state="bf16"), "prefill_c16g_c16_bf16",
         C16G_FULL),
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=64, total_tokens=4 * 8192), "prefill_c16ws_f32", C16G_FULL),
        (prefill_meta(gate="bounded", num_seqs=256, value_heads=1, total_tokens=256 * 4096), "prefill_c16ws_f32"),  # fused_chunk16_long
        (prefill_meta(gate="bounded", num_seqs=256, value_heads=1, total_tokens=256 * 4096), "prefill_vt64s_f32", CHUNK64),
    ],
    # fused_chunk16_long: the fused kernel unsplit from 256 items while the mean passes fused_chunk16's 2048 tokens
    ("kda_prefill", "fused_chunk16_long", "work_items_min"): [
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=64, total_tokens=4 * 8192), "prefill_c16ws_f32"),
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=96, total_tokens=4 * 8192, state="bf16"), "prefill_c16ws_bf16"),
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=63, total_tokens=4 * 8192), "prefill_c16g_c16_f32"),  # c16g_full
    ],
    ("kda_prefill", "fused_chunk16_long", "mean_seqlen_min"): [
        (prefill_meta(gate="bounded", num_seqs=64, value_heads=16, total_tokens=64 * 2048 + 64), "prefill_c16ws_f32"),
        (prefill_meta(gate="bounded", num_seqs=64, value_heads=16, total_tokens=64 * 2048), "prefill_c16ws_f32"),  # fused_chunk16
        (prefill_meta(gate="bounded", num_seqs=64, value_heads=16, total_tokens=64 * 2048 + 64, checkpoints=True),
         "prefill_vt64s_f32"),
        (prefill_meta(num_seqs=64, value_heads=16, total_tokens=64 * 2048 + 64), "prefill_c16ws_f32"),   # softplus: _decay
        (prefill_meta(num_seqs=64, value_heads=16, total_tokens=64 * 2048 + 64), "prefill_vt64s_f32", CHUNK64),
    ],
    # a known longest sequence: token-heads >= 100 times it (4 x 8192 x 64 // 20971 = 100)
    ("kda_prefill", "fused_chunk16_long", "work_per_longest_min"): [
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=64, total_tokens=4 * 8192, max_seqlen=20971),
         "prefill_c16ws_f32"),
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=64, total_tokens=4 * 8192, max_seqlen=20972),
         "prefill_vt64s_f32"),    # many_seq_heads
    ],
    ("kda_prefill", "c16g_full", "mean_seqlen_min"): [
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=48, total_tokens=4 * 2048), "prefill_c16g_c16_f32", C16G_FULL),
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=48, total_tokens=4 * 2048 - 1), "prefill_vt64_f32", C16G_FULL),
    ],
    ("kda_prefill", "c16g_full", "lower_bound_min"): [
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=48, total_tokens=4 * 8192, lower_bound=-5.0),
         "prefill_c16g_c16_f32", C16G_FULL),
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=48, total_tokens=4 * 8192, lower_bound=-5.01),
         "prefill_vt64_f32", C16G_FULL),
        (prefill_meta(num_seqs=4, value_heads=48, total_tokens=4 * 8192), "prefill_c16ws_f32"),   # softplus: c16g_full_decay
    ],
    # c16g_mixed: each sequence's pieces from its own length, for a batch whose longest sequence the caller names
    # (max_seqlen) at >= 1.5x the mean; bounded gates at lower_bound >= -5, 56..383 items, mean <= 2048
    ("kda_prefill", "c16g_mixed", "max_seqlen_min"): [
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=8 * 1088, max_seqlen=1024),
         "prefill_c16gm_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=8 * 1088), "prefill_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=8 * 1088, max_seqlen=1024),
         "prefill_vt64_f32", CHUNK64),
    ],
    ("kda_prefill", "c16g_mixed", "longest_vs_mean_pct_min"): [
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=16000, max_seqlen=1500),
         "prefill_c16gm_vt64_f32"),    # 150
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=16000, max_seqlen=1499),
         "prefill_vt64_f32"),          # 149 (work_per_longest 85: not c16g_mid's)
    ],
    ("kda_prefill", "c16g_mixed", "lower_bound_min"): [
        (prefill_meta(gate="bounded", num_seqs=7, value_heads=16, total_tokens=8192, max_seqlen=3000, lower_bound=-5.0),
         "prefill_c16gm_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=7, value_heads=16, total_tokens=8192, max_seqlen=3000, lower_bound=-5.01),
         "prefill_vt64_f32"),
        (prefill_meta(num_seqs=7, value_heads=16, total_tokens=8192, max_seqlen=3000), "prefill_vt64_f32"),   # softplus
        (prefill_meta(gate="bounded", num_seqs=7, value_heads=16, total_tokens=8192, max_seqlen=3000, checkpoints=True),
         "prefill_vt64_f32"),
    ],
    ("kda_prefill", "c16g_mixed", "work_items_min"): [
        (prefill_meta(gate="bounded", num_seqs=7, value_heads=8, total_tokens=8192, max_seqlen=3000, state="bf16"),
         "prefill_c16gm_vt64_bf16"),   # ragged7 8K H8: 56 items
        (prefill_meta(gate="bounded", num_seqs=1 + 40, value_heads=1, total_tokens=41 * 400, max_seqlen=800),
         "prefill_vt64_f32", CHUNK64),  # 41 items: c16g_mixed's opt-out
        (prefill_meta(gate="bounded", num_seqs=40, value_heads=1, total_tokens=40 * 400, max_seqlen=800),
         "prefill_vt32_f32", CHUNK64),  # 40: c16g_mixed_some's
    ],
    ("kda_prefill", "c16g_mixed", "work_items_max"): [
        (prefill_meta(gate="bounded", num_seqs=255, value_heads=1, total_tokens=255 * 512, max_seqlen=1024),
         "prefill_c16gm_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=255, value_heads=1, total_tokens=255 * 512, max_seqlen=1024),
         "prefill_vt64_f32", CHUNK64),
        (prefill_meta(gate="bounded", num_seqs=256, value_heads=1, total_tokens=256 * 512, max_seqlen=1024),
         "prefill_vt64s_f32", CHUNK64),   # c16g_mixed_many's opt-out
    ],
    # c16g_mixed_many: what fused_chunk16_wave leaves of 256..383 items (token-heads < 100 times the longest, so the
    # longest is more than 2.56 times the mean)
    ("kda_prefill", "c16g_mixed_many", "work_items_min"): [
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16000, max_seqlen=2600),
         "prefill_c16gm_vt64_f32"),   # 256 items, work_per_longest 98
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16000, max_seqlen=2600, state="bf16"),
         "prefill_vt64s_bf16", CHUNK64),
        (prefill_meta(gate="bounded", num_seqs=15, value_heads=17, total_tokens=15000, max_seqlen=2100, state="bf16"),
         "prefill_vt64_bf16", CHUNK64),   # 255 items: c16g_mixed's opt-out
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=8 * 1088, max_seqlen=1024),
         "prefill_c16ws_f32"),   # 8x(1024+64) H16: work_per_longest 136, fused_chunk16_wave
    ],
    ("kda_prefill", "c16g_mixed_many", "mean_seqlen_max"): [
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 2048, max_seqlen=5300),
         "prefill_c16gm_vt64_f32"),   # work_per_longest 98
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 2049, max_seqlen=4200),
         "prefill_c16ws_f32"),     # fused_chunk16_long (work_per_longest 124 >= its 100)
    ],
    ("kda_prefill", "c16g_mixed_many", "lower_bound_min"): [
        (prefill_meta(gate="bounded", num_seqs=7, value_heads=48, total_tokens=8192, max_seqlen=4000, lower_bound=-5.0),
         "prefill_c16gm_vt64_f32"),   # 336 items, work_per_longest 98
        (prefill_meta(gate="bounded", num_seqs=7, value_heads=48, total_tokens=8192, max_seqlen=4000, lower_bound=-5.01),
         "prefill_vt64s_f32"),
        (prefill_meta(gate="bounded", num_seqs=7, value_heads=48, total_tokens=8192, max_seqlen=3000),
         "prefill_c16ws_f32"),   # ragged7 8K H48: work_per_longest 131, fused_chunk16_wave
    ],
    ("kda_prefill", "c16g_mixed_many", "max_seqlen_min"): [
        (prefill_meta(gate="bounded", num_seqs=32, value_heads=8, total_tokens=32000), "prefill_vt64s_f32"),
    ],
    ("kda_prefill", "c16g_mixed_many", "work_items_max"): [
        (prefill_meta(gate="bounded", num_seqs=383, value_heads=1, total_tokens=383 * 512, max_seqlen=2000),
         "prefill_c16gm_vt64_f32"),      # work_per_longest 98
        (prefill_meta(gate="bounded", num_seqs=384, value_heads=1, total_tokens=384 * 512, max_seqlen=1600),
         "prefill_c16ws_f32"),           # fused_chunk16 (work_per_longest 122 >= its 100)
    ],
    ("kda_prefill", "c16g_mixed", "mean_seqlen_max"): [
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=16, total_tokens=4 * 8192, max_seqlen=16384),
         "prefill_c16gm_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=16, total_tokens=4 * 8193, max_seqlen=16386),
         "prefill_c16g_vt64_f32"),     # c16g_wide
    ],
    # c16g_mixed_some: 17..40 items, its opt-out the chunk-64 module of some_seq_heads
    ("kda_prefill", "c16g_mixed_some", "work_items_min"): [
        (prefill_meta(gate="bounded", num_seqs=17, value_heads=1, total_tokens=17 * 400, max_seqlen=800),
         "prefill_c16gm_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=17, value_heads=1, total_tokens=17 * 400, max_seqlen=800),
         "prefill_vt32_f32", CHUNK64),
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=1, total_tokens=16 * 400, max_seqlen=800),
         "prefill_vt16_f32"),          # few_seq_heads
    ],
    ("kda_prefill", "c16g_mixed_some", "work_items_max"): [
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=10, total_tokens=4 * 4096, max_seqlen=8192),
         "prefill_c16gm_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=10, total_tokens=4 * 4096, max_seqlen=8192, state="bf16"),
         "prefill_vt32_bf16", CHUNK64),
    ],
    ("kda_prefill", "c16g_mixed_some", "longest_vs_mean_pct_min"): [
        (prefill_meta(gate="bounded", num_seqs=2, value_heads=16, total_tokens=16384, max_seqlen=12288),
         "prefill_c16gm_vt64_f32"),    # 150 (3000+13384 H16 is 163)
        (prefill_meta(gate="bounded", num_seqs=2, value_heads=16, total_tokens=16384, max_seqlen=12287),
         "prefill_c16g_vt32_f32"),     # 149: c16g_some
    ],
    ("kda_prefill", "c16g_mixed_some", "max_seqlen_min"): [
        (prefill_meta(gate="bounded", num_seqs=2, value_heads=16, total_tokens=16384), "prefill_c16g_vt32_f32"),
    ],
    ("kda_prefill", "c16g_mixed_some", "mean_seqlen_max"): [
        (prefill_meta(gate="bounded", num_seqs=2, value_heads=16, total_tokens=16384, max_seqlen=13384),
         "prefill_c16gm_vt64_f32"),    # 3000+13384 H16: mean 8192
        (prefill_meta(gate="bounded", num_seqs=2, value_heads=16, total_tokens=16386, max_seqlen=13384),
         "prefill_c16g_vt32_f32"),
    ],
    ("kda_prefill", "c16g_mixed_some", "lower_bound_min"): [
        (prefill_meta(gate="bounded", num_seqs=2, value_heads=16, total_tokens=16384, max_seqlen=13384, lower_bound=-5.01),
         "prefill_vt32_f32"),
        (prefill_meta(gate="bounded", num_seqs=2, value_heads=16, total_tokens=16384, max_seqlen=13384, checkpoints=True),
         "prefill_vt32_f32"),
    ],
    ("kda_prefill", "c16g_wide", "mean_seqlen_min"): [
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=32, total_tokens=4 * 2048), "prefill_c16g_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=32, total_tokens=4 * 2048 - 1, max_seqlen=2048),
         "prefill_vt64_f32"),     # work_per_longest 127: not c16g_mid's either
        (prefill_meta(gate="bounded", num_seqs=4, value_heads=32, total_tokens=4 * 2048, checkpoints=True), "prefill_vt64_f32"),
    ],
    # c16g_mid: the guarded split over fallback's kernels at 128..255 items of 512-2047 tokens on average, the longest
    # sequence no longer than token-heads / 128 (like-length prompts)
    ("kda_prefill", "c16g_mid", "work_items_min"): [
        (like(128, 1, 512), "prefill_c16g_vt64_f32"),
        (like(127, 1, 512), "prefill_vt64_f32"),
    ],
    ("kda_prefill", "c16g_mid", "work_items_max"): [
        (like(255, 1, 512), "prefill_c16g_vt64_f32"),
        (like(256, 1, 512), "prefill_c16ws_f32"),  # the wave
        (prefill_meta(gate="bounded", num_seqs=256, value_heads=1, total_tokens=256 * 512, max_seqlen=1400),
         "prefill_c16gm_vt64_f32"),    # work_per_longest 93: not the wave, c16g_mixed_many
    ],
    ("kda_prefill", "c16g_mid", "mean_seqlen_min"): [
        (like(16, 8, 512), "prefill_c16g_vt64_f32"),
        (prefill_meta(max_seqlen=512, gate="bounded", num_seqs=16, value_heads=8, total_tokens=16 * 512 - 1),
         "prefill_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=16 * 512, checkpoints=True),
         "prefill_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=16 * 512), "prefill_vt64_f32", CHUNK64),
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 512), "prefill_vt64_f32"),   # softplus
    ],
    ("kda_prefill", "c16g_mid", "work_per_longest_min"): [
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1024),
         "prefill_c16g_vt64_f32"),    # 128
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1025),
         "prefill_vt64_f32"),         # 127
    ],
    ("kda_prefill", "c16g_mid", "max_seqlen_min"): [   # the longest known: a ragged batch by the mean looks uniform
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1024),
         "prefill_c16g_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=8, total_tokens=16 * 1024), "prefill_vt64_f32"),
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=12, total_tokens=8 * 1088), "prefill_vt64_f32"),
    ],
    # fused_chunk16_wave: the fused kernel unsplit at 256..383 items, token-heads >= 100 times the longest (ahead of
    # c16g_mixed_many)
    ("kda_prefill", "fused_chunk16_wave", "max_seqlen_min"): [   # the longest known, as c16g_mid's
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=1024),
         "prefill_c16ws_f32"),
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 1024), "prefill_vt64s_f32"),
    ],
    ("kda_prefill", "fused_chunk16_wave", "work_items_min"): [
        (like(16, 16, 1024), "prefill_c16ws_f32"),
        (like(255, 1, 1024), "prefill_c16g_vt64_f32"),
    ],
    ("kda_prefill", "fused_chunk16_wave", "work_items_max"): [
        (like(383, 1, 1024), "prefill_c16ws_f32"),
        (prefill_meta(gate="bounded", num_seqs=384, value_heads=1, total_tokens=384 * 1024, max_seqlen=3840),
         "prefill_c16ws_f32"),       # fused_chunk16 (work_per_longest 102)
        (prefill_meta(gate="bounded", num_seqs=383, value_heads=1, total_tokens=383 * 1024, max_seqlen=3830),
         "prefill_c16ws_f32"),       # 102 >= 100
        (prefill_meta(gate="bounded", num_seqs=383, value_heads=1, total_tokens=383 * 1024, max_seqlen=3940),
         "prefill_c16gm_vt64_f32"),     # 99 < 100; the longest 3.8x the mean: c16g_mixed_many
        (prefill_meta(gate="bounded", num_seqs=383, value_heads=1, total_tokens=383 * 1024, max_seqlen=3830),
         "prefill_vt64s_f32", CHUNK64),
    ],
    ("kda_prefill", "fused_chunk16_wave", "mean_seqlen_max"): [
        (like(16, 16, 2048), "prefill_c16ws_f32"),
        (prefill_meta(max_seqlen=2049, gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 2048 + 16),
         "prefill_c16ws_f32"),    # fused_chunk16_long
        (prefill_meta(max_seqlen=2049, gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 2048 + 16),
         "prefill_vt64s_f32", CHUNK64),
    ],
    ("kda_prefill", "fused_chunk16_wave", "work_per_longest_min"): [
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=2621),
         "prefill_c16ws_f32"),       # 100
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=2622),
         "prefill_c16gm_vt64_f32"),     # 99: c16g_mixed_many (the longest 2.6x the mean)
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=2621),
         "prefill_vt64s_f32", CHUNK64),
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 1024), "prefill_vt64s_f32", CHUNK64),
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 1024), "prefill_vt64s_f32"),   # softplus
        (prefill_meta(gate="bounded", num_seqs=16, value_heads=16, total_tokens=16 * 1024, checkpoints=True),
         "prefill_vt64s_f32"),
    ],
    # fused_chunk16_wave's twin for the softplus and log gates (fused_chunk16_wave_decay)
    ("kda_prefill", "fused_chunk16_wave_decay", "max_seqlen_min"): [
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=1024), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 1024), "prefill_vt64s_f32"),
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=1024), "prefill_vt64s_f32", CHUNK64),
    ],
    ("kda_prefill", "fused_chunk16_wave_decay", "work_items_min"): [
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=1024, gate="log"), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=255, value_heads=1, total_tokens=255 * 1024, max_seqlen=1024),
         "prefill_c16g_vt64_f32"),   # 255: c16g_mid_decay
    ],
    ("kda_prefill", "fused_chunk16_wave_decay", "work_items_max"): [
        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 1024, max_seqlen=1024), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 1024, max_seqlen=3830), "prefill_c16ws_f32"),  # 102
        (prefill_meta(num_seqs=383, value_heads=1, total_tokens=383 * 1024, max_seqlen=3940), "prefill_vt64s_f32"),  # 99
        (prefill_meta(num_seqs=384, value_heads=1, total_tokens=384 * 1024, max_seqlen=3840),
         "prefill_c16ws_f32"),       # fused_chunk16_decay (work_per_longest 102 >= its 100)
    ],
    ("kda_prefill", "fused_chunk16_wave_decay", "mean_seqlen_max"): [
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 2048, max_seqlen=2048), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 2048 + 16, max_seqlen=2049),
         "prefill_c16ws_f32"),       # fused_chunk16_long_decay
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 2048 + 16, max_seqlen=2049), "prefill_vt64s_f32", CHUNK64),
    ],
    ("kda_prefill", "fused_chunk16_wave_decay", "work_per_longest_min"): [
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=2621), "prefill_c16ws_f32"),    # 100
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=2622), "prefill_vt64s_f32"),    # 99
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=2621, gate="log", state="bf16"),
         "prefill_c16ws_bf16"),
        (prefill_meta(num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=1024, checkpoints=True),
         "prefill_vt64s_f32"),
    ],
    # the softplus and log gates' twins of the fused bands (prefill_c16ws_*'s checked kernels): fused_chunk16_long's
    # edges, and c16g_full's from 192 items (below it the unsplit role split takes two rounds for less work)
    ("kda_prefill", "fused_chunk16_long_decay", "work_items_min"): [
        (prefill_meta(num_seqs=4, value_heads=64, total_tokens=4 * 8192), "prefill_c16ws_f32"),                 # 256
        (prefill_meta(num_seqs=4, value_heads=96, total_tokens=4 * 8192, gate="log", state="bf16"), "prefill_c16ws_bf16"),
        (prefill_meta(num_seqs=4, value_heads=63, total_tokens=4 * 8192), "prefill_c16ws_f32"),   # 252: c16g_full_decay
        (prefill_meta(num_seqs=4, value_heads=64, total_tokens=4 * 8192, checkpoints=True), "prefill_vt64s_f32"),
    ],
    ("kda_prefill", "fused_chunk16_long_decay", "mean_seqlen_min"): [
        (prefill_meta(num_seqs=64, value_heads=16, total_tokens=64 * 2048 + 64, gate="log"), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=64, value_heads=16, total_tokens=64 * 2048), "prefill_c16ws_f32"),   # fused_chunk16_decay
        (prefill_meta(num_seqs=64, value_heads=16, total_tokens=64 * 2048), "prefill_vt64s_f32", CHUNK64),
    ],
    ("kda_prefill", "fused_chunk16_long_decay", "work_per_longest_min"): [
        (prefill_meta(num_seqs=4, value_heads=64, total_tokens=4 * 8192, max_seqlen=20971), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=4, value_heads=64, total_tokens=4 * 8192, max_seqlen=20972), "prefill_vt64s_f32"),
    ],
    ("kda_prefill", "c16g_full_decay", "work_items_min"): [
        (prefill_meta(num_seqs=4, value_heads=48, total_tokens=4 * 8192), "prefill_c16ws_f32"),                  # 192
        (prefill_meta(num_seqs=1, value_heads=191, total_tokens=4096, gate="log"), "prefill_vt64_f32"),          # 191
        (prefill_meta(num_seqs=7, value_heads=19, total_tokens=7 * 4096), "prefill_vt64_f32"),                   # 133
        (prefill_meta(num_seqs=4, value_heads=48, total_tokens=4 * 8192), "prefill_vt64_f32", CHUNK64),
    ],
    ("kda_prefill", "c16g_full_decay", "work_items_max"): [
        (prefill_meta(num_seqs=5, value_heads=51, total_tokens=5 * 4096, state="bf16"), "prefill_c16ws_bf16"),   # 255
        (prefill_meta(num_seqs=256, value_heads=1, total_tokens=256 * 2048), "prefill_vt64s_f32"),   # many_seq_heads
    ],
    ("kda_prefill", "c16g_full_decay", "mean_seqlen_min"): [
        (prefill_meta(num_seqs=4, value_heads=48, total_tokens=4 * 2048, gate="log"), "prefill_c16ws_f32"),
        (prefill_meta(num_seqs=4, value_heads=48, total_tokens=4 * 2048 - 1), "prefill_vt64_f32"),
        (prefill_meta(num_seqs=4, value_heads=48, total_tokens=4 * 8192, checkpoints=True), "prefill_vt64_f32"),
    ],
    # c16g_mid's twin for the softplus gate (c16g_mid_decay): like-length prompts of 512-2048 tokens at 128..255 items,
    # the longest given; longer prompts below 192 items, and the log gate, keep fallback's module
    ("kda_prefill", "c16g_mid_decay", "work_items_min"): [
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1024), "prefill_c16g_vt64_f32"),
        (prefill_meta(num_seqs=127, value_heads=1, total_tokens=127 * 1024, max_seqlen=1024), "prefill_vt64_f32"),
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1024), "prefill_vt64_f32", CHUNK64),
    ],
    ("kda_prefill", "c16g_mid_decay", "work_items_max"): [
        (prefill_meta(num_seqs=255, value_heads=1, total_tokens=255 * 1024, max_seqlen=1024, state="bf16"),
         "prefill_c16g_vt64_bf16"),
        (prefill_meta(num_seqs=255, value_heads=1, total_tokens=255 * 1024, max_seqlen=1024, gate="log"),
         "prefill_vt64_f32"),        # the log gate: fallback
        (prefill_meta(num_seqs=256, value_heads=1, total_tokens=256 * 1024, max_seqlen=1024),
         "prefill_c16ws_f32"),       # fused_chunk16_wave_decay
    ],
    ("kda_prefill", "c16g_mid_decay", "mean_seqlen_min"): [
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 512, max_seqlen=512), "prefill_c16g_vt64_f32"),
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 512 - 1, max_seqlen=512), "prefill_vt64_f32"),
    ],
    ("kda_prefill", "c16g_mid_decay", "mean_seqlen_max"): [
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 2048, max_seqlen=2048), "prefill_c16g_vt64_f32"),
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 2048 + 16, max_seqlen=2049), "prefill_vt64_f32"),
        (prefill_meta(num_seqs=4, value_heads=48, total_tokens=4 * 2048, max_seqlen=2048),
         "prefill_c16ws_f32"),       # 192 items: c16g_full_decay first
    ],
    ("kda_prefill", "c16g_mid_decay", "work_per_longest_min"): [
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1024), "prefill_c16g_vt64_f32"),  # 128
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1025), "prefill_vt64_f32"),  # 127
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1024, checkpoints=True),
         "prefill_vt64_f32"),
    ],
    ("kda_prefill", "c16g_mid_decay", "max_seqlen_min"): [
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1024), "prefill_c16g_vt64_f32"),
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 1024), "prefill_vt64_f32"),   # the longest not given
        (prefill_meta(num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1024, gate="log"), "prefill_vt64_f32"),
    ],
    # fused_kda_verify: fp32 at one CTA an SM while the grid has no more CTAs than an H200 has SMs, then (and bf16
    # always) fused_verify_row2 at two
    ("fused_kda_verify", "f32_few", "work_items_max"): [
        (verify_meta(num_seqs=33, value_heads=4, max_seqlen=4), "fused_verify_row_f32_o32"),      # 132
        (verify_meta(num_seqs=133, value_heads=1, max_seqlen=4, offset="o64"), "fused_verify_row2_f32_o64"),  # 133
        (verify_meta(num_seqs=1, value_heads=16, max_seqlen=4, state="bf16"), "fused_verify_row2_bf16_o32"),
    ],
}


# The bounded-gate rules of the fused kernel's split and wave: lower_bound >= -5 keeps its chunks in the factored range;
# below it, and for the softplus gate, the band's chunk-64 module (the rule's chunk64 twin's): (rule, call, its module
# there, the chunk-64 one)
BOUNDED_ONLY = [
    ("c16g_few", dict(value_heads=8, total_tokens=32768), "prefill_c16g2_pc8_vt64_f32", "prefill_pc8_vt64_f32"),
    ("c16g_groups", dict(value_heads=12, total_tokens=8192), "prefill_c16g_vt16_f32", "prefill_pc16_vt64g2_f32"),
    ("c16g_groups_24", dict(value_heads=24, total_tokens=8192), "prefill_c16g_vt32_f32", "prefill_pc16_vt64g2_f32"),
    ("c16g_groups_32", dict(value_heads=32, total_tokens=16384), "prefill_c16g_vt32_f32", "prefill_pc16_vt64g2_f32"),
    ("c16g_some", dict(value_heads=32, total_tokens=2048), "prefill_c16g_vt32_f32", "prefill_vt32_f32"),
    ("c16g_wide", dict(num_seqs=4, value_heads=32, total_tokens=4 * 2048), "prefill_c16g_vt64_f32", "prefill_vt64_f32"),
    ("c16g_mid", dict(num_seqs=16, value_heads=8, total_tokens=16 * 1024, max_seqlen=1024), "prefill_c16g_vt64_f32",
     "prefill_vt64_f32"),
    ("fused_chunk16_long", dict(num_seqs=4, value_heads=96, total_tokens=4 * 8192), "prefill_c16ws_f32", "prefill_vt64s_f32"),
    ("fused_chunk16_wave", dict(num_seqs=16, value_heads=16, total_tokens=16 * 1024, max_seqlen=1024), "prefill_c16ws_f32",
     "prefill_vt64s_f32"),
]
# the bounded rules whose band the softplus and log gates share through a twin rule (<rule>_decay)
DECAY_TWINS = {"fused_chunk16_long": "prefill_c16ws_f32", "fused_chunk16_wave": "prefill_c16ws_f32",
               "c16g_mid": "prefill_c16g_vt64_f32"}
EDGES.update({("kda_prefill", rule, "lower_bound_min"): [
    (prefill_meta(gate="bounded", lower_bound=-5.0, **call), module),
    (prefill_meta(gate="bounded", lower_bound=-5.01, **call), chunk64),
    (prefill_meta(**call), DECAY_TWINS.get(rule, chunk64)),                       # softplus
    (prefill_meta(gate="bounded", lower_bound=-5.0, **call), chunk64, CHUNK64)] for rule, call, module, chunk64 in BOUNDED_ONLY})


# kda_verify's _gb32 rules (fp32 g / beta): the twin of each band at its edges, module for module
EDGES.update({(family, rule + "_gb32", band): [(dict(meta, gb="f32"), module + "_gb32", *opted)
                                                for meta, module, *opted in cases]
              for (family, rule, band, *_), cases in list(EDGES.items()) if family == "kda_verify"})


@pytest.mark.parametrize("key", sorted(EDGES), ids=lambda k: "-".join(k))
def test_band_edges(key):
    family = key[0]
    for meta, expected, *opted in EDGES[key]:
        assert dispatch.module_name(family, meta, *opted) == expected, (key, meta)
        assert jit.get_record(expected)["family"] == family


def test_every_band_edge_is_covered():
    bands = set()
    for path in sorted(jit_dir().glob("routes/*.json")):
        data = json.loads(path.read_text())
        for rule in data["rules"]:
            for cond in rule.get("when", {}):
                if cond.endswith("_min") or cond.endswith("_max"):
                    bands.add((data["family"], rule["name"], cond))
    assert bands, "no bands found"
    assert bands <= set(EDGES), f"bands without boundary cases: {sorted(bands - set(EDGES))}"


@pytest.mark.parametrize("family", ["kda_decode", "fused_kda_decode"])
def test_repeated_slots_always_take_the_sequential_route(family):
    for rows in (1, 64, 4096):
        name = dispatch.module_name(family, decode_meta(rows=rows, slot_mode="repeated"))
        assert jit.get_record(name)["abi"] == "sequential", name


@pytest.mark.parametrize("family", ["kda_decode", "kda_prefill", "fused_kda_decode"])
def test_cpu_tensors_take_the_cpu_module(family):
    meta = (prefill_meta if family == "kda_prefill" else decode_meta)(device="cpu")
    assert jit.get_record(dispatch.module_name(family, meta))["backend"] == "cpu"


def test_unknown_band_value_stays_on_the_fallback():
    # a range condition on an unknown value never holds: the always-true fallback serves the call
    meta = prefill_meta()
    meta["work_items"] = None
    rule = dispatch.select_rule("kda_prefill", meta)
    assert rule["name"] == "fallback"


def _decode_points():
    for state in ("f32", "bf16"):
        for offset in ("o32", "o64"):
            for slot_mode in ("unique", "padded", "repeated"):
                for hv in (1, 8, 15, 16, 64):
                    for rows in (1, 2, 4, 16, 31, 32, 64, 128, 129, 256, 1023, 1024, 4096):
                        yield decode_meta(rows=rows, value_heads=hv, state=state, offset=offset, slot_mode=slot_mode)


def _verify_points():
    for state in ("f32", "bf16"):
        for offset in ("o32", "o64"):
            for hv in (1, 8, 16, 64):
                for n in (1, 2, 4, 16, 17, 64, 65, 1024):
                    for max_seqlen in (2, 3, 4, 5, 8):
                        yield verify_meta(num_seqs=n, value_heads=hv, state=state, offset=offset, max_seqlen=max_seqlen)


@pytest.mark.parametrize("family,points", [("kda_decode", _decode_points), ("kda_verify", _verify_points)])
def test_fp32_gate_beta_takes_the_gb32_twin_of_every_band(family, points):
    """gb = "f32" picks, at every point, the module the same call with bf16 g and beta picks plus _gb32,
    a record that reads g and beta as fp32; without the key (callers from before it) nothing changes."""
    for meta in points():
        base = dispatch.module_name(family, dict(meta, gb="input"))
        assert dispatch.module_name(family, meta) == base  # no gb key: as before
        twin = dispatch.module_name(family, dict(meta, gb="f32"))
        assert twin == base + "_gb32", meta
        rec, brec = jit.get_record(twin), jit.get_record(base)
        assert rec["params"].get("gb_f32") == 1 and not brec["params"].get("gb_f32")
        # the twin differs from its module only by the fp32 reads (and, for every routed one, is AOT-built)
        for key in ("abi", "threads", "smem_bytes", "min_blocks", "cluster", "persistent_k", "state_dtype",
                    "slot_offset_bits", "sources", "flags", "arches"):
            assert rec[key] == brec[key], (twin, key)
        assert {k: v for k, v in rec["params"].items() if k != "gb_f32"} == brec["params"]
        assert rec["aot"]


@pytest.mark.parametrize("family", ["kda_decode", "kda_verify"])
def test_gb32_rules_are_twins_of_the_rule_after_them(family):
    rules = jit.routes_for(family)
    for i, rule in enumerate(rules):
        if rule["when"].get("device") != "cuda":
            continue
        if rule["name"].endswith("_gb32"):
            nxt = rules[i + 1]
            assert rule["name"] == nxt["name"] + "_gb32"
            assert rule["module"] == nxt["module"] + "_gb32"
            assert {k: v for k, v in rule["when"].items() if k != "gb"} == nxt["when"]
            assert rule["when"]["gb"] == "f32"
        else:
            assert rules[i - 1]["name"] == rule["name"] + "_gb32", f"CUDA rule {rule['name']} has no _gb32 twin before it"


def test_cpu_route_ignores_gb():
    assert dispatch.module_name("kda_decode", decode_meta(device="cpu", gb="f32")) == "cpu_kda_decode"
    assert dispatch.module_name("kda_verify", verify_meta(device="cpu", gb="f32")) == "cpu_kda_verify"
    assert dispatch.gb_read_dtype("cpu_kda_decode", "bfloat16") is None
    assert dispatch.gb_read_dtype("decode_split8_f32_o32_gb32", "bfloat16") == "float32"
    assert dispatch.gb_read_dtype("decode_split8_f32_o32", "bfloat16") == "bfloat16"


# Opt-in rules (docs/jit.md, "Opt-in routes"): considered only when their name is opted in.
def test_opt_in_persistent_route_is_reachable_only_when_opted_in():
    for meta in _decode_points():
        for gb in ("input", "f32"):
            m = dict(meta, gb=gb)
            plain = dispatch.module_name("kda_decode", m)
            assert not jit.get_record(plain).get("opt_in"), m
            opted = dispatch.module_name("kda_decode", m, {"persistent"})
            if m["slot_mode"] == "repeated":  # row order needs the sequential module, opted in or not
                assert opted == plain, m
                continue
            assert opted == f"decode_stream_{m['state']}_{m['offset']}" + ("_gb32" if gb == "f32" else ""), m
            rec = jit.get_record(opted)
            assert rec["opt_in"] and rec["persistent_k"] > 0 and rec["abi"] == "persistent_rows"
    assert dispatch.module_name("kda_decode", decode_meta(device="cpu"), {"persistent"}) == "cpu_kda_decode"


def test_piece_split_serves_long_prompts_and_never_checkpoints():
    """fp32 or bf16 state, no checkpoints, long prompts: <= 8 sequences x heads at >= 8192 tokens a sequence on
    average take the one-group vt64 split (up to 8 pieces), 9..24 at >= 8192 and 25..32 at >= 16384 the two-group
    split (up to 16 pieces), each in the state's dtype; 'exact_chain' keeps such calls on the unsplit module the
    bands below would pick, and changes nothing else; a piece-split module is never picked for a call with
    checkpoints."""
    for state in ("f32", "bf16"):
        for hv in (1, 2, 4, 8, 9, 16, 17, 24, 32, 33, 64):
            for seqs in (1, 2):
                for tokens in (64, 8191, 8192, 16384, 32768, 65536, 131072):
                    for ckpt in (False, True):
                        meta = prefill_meta(num_seqs=seqs, value_heads=hv, total_tokens=tokens, state=state,
                                            checkpoints=ckpt)
                        got = dispatch.module_name("kda_prefill", meta, ())
                        exact = dispatch.module_name("kda_prefill", meta, EXACT)
                        items, mean = seqs * hv, tokens // seqs
                        long = not ckpt and ((mean >= 8192 and items <= 24) or (mean >= 16384 and items <= 32))
                        assert not jit.get_record(exact)["params"].get("pieces"), meta
                        assert not jit.get_record(got).get("opt_in"), meta
                        if long:
                            want = "prefill_pc8_vt64" if items <= 8 else "prefill_pc16_vt64g2"
                            assert got == f"{want}_{state}", meta
                            assert exact == f"prefill_vt{16 if items <= 16 else 32}_{state}", meta
                        else:
                            assert exact == got and not jit.get_record(got)["params"].get("pieces"), meta
    assert dispatch.module_name("kda_prefill", prefill_meta(device="cpu", total_tokens=65536), ()) == "cpu_kda_prefill"


def test_c16_opt_in_serves_every_call_without_checkpoints():
    """'c16' (the fused 16-token-chunk kernel; 'c16p' its piece-split twin) takes every CUDA call without checkpoints,
    in the state's dtype, whatever the band, the gate and the lower bound; checkpoints and the CPU keep their routes.
    Without the opt-in, the fused kernel is reached only in fused_chunk16's band (prefill_c16ws_*, the same kernel split
    by role, for every gate), the unguarded piece split never (its
    binding refuses checkpoints: tests/gpu/test_prefill_c16_gpu.py) and the guarded ones (c16g_*, c16g2_*) only for bounded
    gates without checkpoints."""
    c16 = frozenset({"c16"})
    for state in ("f32", "bf16"):
        for hv, seqs, tokens in ((16, 64, 32768), (32, 4, 16384), (64, 1, 8192), (8, 1, 32768), (1, 1, 1)):
            for gate, lb in (("bounded", -5.0), ("bounded", -1.0), ("bounded", -5.5), ("softplus", None), ("log", None)):
                for ckpt in (False, True):
                    meta = prefill_meta(num_seqs=seqs, value_heads=hv, total_tokens=tokens, state=state, gate=gate,
                                        checkpoints=ckpt, lower_bound=lb)
                    plain = dispatch.module_name("kda_prefill", meta, ())
                    got = dispatch.module_name("kda_prefill", meta, c16)
                    split = dispatch.module_name("kda_prefill", meta, {"c16p"})
                    served = not ckpt
                    band = (served and (gate != "bounded" or lb >= -5) and seqs * hv >= 384
                            and tokens // seqs <= 2048)
                    fused = f"prefill_c16ws_{state}"   # split by role
                    assert plain == (fused if band else plain) and not plain.startswith("prefill_c16p")
                    guarded = plain.startswith(("prefill_c16g_", "prefill_c16g2_"))   # routes c16g_*: bounded, long
                    assert band or guarded or not plain.startswith("prefill_c16"), meta
                    assert not guarded or (served and gate == "bounded" and lb >= -5 and tokens // seqs >= 2048), meta
                    if served:
                        assert got == f"prefill_c16_{state}" and not jit.get_record(got).get("opt_in"), meta
                        assert split == f"prefill_c16p_{state}" and jit.get_record(split)["params"]["pieces"] > 1, meta
                    else:
                        assert got == plain and split == plain, meta
    assert dispatch.module_name("kda_prefill", prefill_meta(device="cpu", gate="bounded"), c16) == "cpu_kda_prefill"


def test_opt_in_comes_from_the_environment_and_is_validated(monkeypatch):
    meta = decode_meta(rows=64, value_heads=16)
    monkeypatch.delenv(dispatch.OPT_IN_ENV, raising=False)
    assert dispatch.module_name("kda_decode", meta) == "decode_split8_f32_o32"
    monkeypatch.setenv(dispatch.OPT_IN_ENV, " persistent ,")
    assert dispatch.module_name("kda_decode", meta) == "decode_stream_f32_o32"
    monkeypatch.setenv(dispatch.OPT_IN_ENV, "persistant")
    for _ in range(2):  # the same error on every call
        with pytest.raises(ValueError, match=r"FLASHKDA_EXT_OPT_IN='persistant' names unknown opt-in .*'persistent'"):
            dispatch.module_name("kda_decode", meta)


# Records no route reaches yet because their family's files belong to another branch of issue 44
# (the prefill probes); empty it once that branch is merged.
def test_every_kernel_record_is_routed_or_an_opt_in():
    """Live kernels only: every record of a routed family is reached by some rule (an opt_in record by
    an opt-in rule only: the registry checks that side); helper families are loaded by name."""
    reg = jit.registry()
    unrouted = {n for n, r in reg.records.items()
                if r["family"] not in jit.specs.HELPER_FAMILIES and n not in reg.routed}
    assert not unrouted, sorted(unrouted)
    assert {n for n, r in reg.records.items() if r.get("opt_in")} <= reg.routed


def test_every_default_routed_cuda_module_is_prebuilt_ahead_of_time():
    """A module some default (not opt-in) rule reaches is `"aot": true`, so a wheel built by aot.py serves every
    default route without nvcc at run time; opt-in modules may stay JIT-only."""
    reg = jit.registry()
    default = set()
    for family, data in reg.routes.items():
        for rule in data["rules"]:
            if "opt_in" in rule:
                continue
            for device in [d for d in ([rule["when"].get("device")] if isinstance(rule["when"].get("device"), str)
                                       else rule["when"].get("device", [])) if d == "cuda"]:
                default.update(reg._expand(rule["module"], rule["when"], family, device, "routes", rule["name"]))
    assert default, "no default CUDA module found"
    missing = sorted(n for n in default if not reg.records[n].get("aot"))
    assert not missing, f"default-routed but not aot: {missing}"


def test_the_spec_mechanisms_have_live_modules():
    """The persistent-grid and cluster launch macros are exercised by real modules: a routed (or opt-in)
    persistent one and routed clustered ones."""
    reg = jit.registry()
    live = [reg.records[n] for n in reg.routed if reg.records[n]["backend"] == "cuda"]
    assert any(r["persistent_k"] > 0 for r in live)
    clustered = {r["abi"] for r in live if r["cluster"] != [1, 1, 1]}
    assert {"cluster_split", "sequential"} <= clustered, clustered


def test_measured_bases_cite_results_that_exist():
    """A rule's structured `measured` names its date, the tree's commit and results files that this
    checkout holds (a wheel ships no benchmarks/: nothing to check there)."""
    root = jit_dir().parent
    if not (root / "benchmarks" / "results").is_dir():
        pytest.skip("no benchmarks/results in this tree")
    cited = 0
    for path in sorted(jit_dir().glob("routes/*.json")):
        for rule in json.loads(path.read_text())["rules"]:
            m = rule.get("measured")
            if isinstance(m, dict):
                for res in m["results"]:
                    assert (root / res).is_file(), (path.name, rule["name"], res)
                    cited += 1
    assert cited >= 20, cited
