"""Loading and validating jit/modules/*.json and jit/routes/*.json.

Each file is checked against its JSON Schema (jit/schema/), then against the rules a schema cannot
express (unique names, sources exist, backend limits, routes that name real modules). The first broken
rule raises SpecError naming the file, the record and the rule. Loaded registries are cached per data
root and reloaded when a jit/ file changes.
"""
from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import os
import string
from pathlib import Path
from typing import Dict, List

from . import families, roots
from .errors import SpecError
from .schema_check import validate
from .toolchain import FORBIDDEN_FLAG_PREFIXES

# Host-known route metadata per family (docs/architecture.md, "Routes").
META_KEYS = {
    "kda_decode": {"device", "rows", "value_heads", "work_items", "state", "offset", "slot_mode",
                   "gate", "gb"},
    "fused_kda_decode": {"device", "rows", "value_heads", "work_items", "state", "offset",
                         "slot_mode", "gate"},
    "kda_prefill": {"device", "num_seqs", "value_heads", "total_tokens", "max_seqlen", "mean_seqlen",
                    "work_items", "work_per_longest", "longest_vs_mean_pct", "state", "offset", "gate", "checkpoints",
                    "lower_bound"},
    "kda_verify": {"device", "num_seqs", "value_heads", "total_tokens", "max_seqlen", "work_items",
                   "state", "offset", "gate", "gb", "tree"},
    "fused_kda_verify": {"device", "num_seqs", "value_heads", "total_tokens", "max_seqlen", "work_items",
                         "state", "offset", "gate"},
}
NUMERIC_META = {"rows", "value_heads", "work_items", "num_seqs", "total_tokens", "max_seqlen", "mean_seqlen",
                "work_per_longest", "longest_vs_mean_pct", "lower_bound"}
STATE_TAGS = families.STATE_TAGS
OFFSET_TAGS = {32: "o32", 64: "o64"}
PERSISTENT_ABIS = {"persistent_rows", "chunked_persistent"}
CLUSTER_ABIS = {"cluster_pair", "cluster_split"}
MAX_CLUSTER = 16          # non-portable cluster size limit on Hopper
MAX_SMEM_PER_SM = 233472  # 228 KiB on H100/H200
MAX_THREADS_PER_SM = 2048
# Helper families: modules with no kernel, loaded by name (never routed) and described by no
# jit/supported.json entry. Host C++ only; their macros render as "any" (docs/jit.md).
HELPER_FAMILIES = ("ffi_reorder",)


@functools.lru_cache(maxsize=4)
def _schema(kind: str) -> dict:
    with open(roots.schema_dir() / f"{kind}.schema.json") as f:
        return json.load(f)


def _read_json(path: Path):
    try:
        with open(path) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise SpecError(path, None, f"not valid JSON: {e}") from None


def _schema_check(kind: str, path: Path, data, list_key: str) -> None:
    errors = validate(_schema(kind), data)
    if not errors:
        return
    e = errors[0]
    p = list(e.path)
    record = None
    field = p
    if len(p) >= 2 and p[0] == list_key and isinstance(p[1], int):
        item = data[list_key][p[1]]
        name = item.get("name") if isinstance(item, dict) else None
        record = name if isinstance(name, str) else f"#{p[1]}"
        field = p[2:]
    where = "/".join(map(str, field)) or ("(whole record)" if record is not None else "(top level)")
    raise SpecError(path, record, f"{where}: {e.message} (schema rule '{e.validator}')")


def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _check_record(rec: dict, fname: str, csrc: Path, root) -> None:
    from .. import supported as _supported  # late: flashkda_ext.supported imports this package

    name = rec["name"]

    def fail(rule):
        raise SpecError(fname, name, rule)

    fam, backend = rec["family"], rec["backend"]
    if rec["entry"] != fam:
        fail(f"entry must be the family's function name '{fam}', not '{rec['entry']}'")
    helper = fam in HELPER_FAMILIES
    if helper:
        if backend != "cpu":
            fail(f"'{fam}' is a helper family: its modules are host C++ (backend 'cpu'), "
                 f"not '{backend}'")
        if rec["state_dtype"] != "any" or rec["params"]:
            fail(f"'{fam}' is a helper family: state_dtype must be 'any' and params empty")
        sup = None
    else:
        sup = _supported.supported(fam, backend, root)
        if sup is None:
            fail(f"jit/supported.json has no entry for family '{fam}' backend '{backend}'")
    for src in rec["sources"]:
        p = (csrc / src)
        if ".." in Path(src).parts or not p.is_file():
            fail(f"source '{src}' does not exist under csrc/")
    exts = {Path(s).suffix for s in rec["sources"]}
    cluster = rec["cluster"]
    csize = math.prod(cluster)
    if backend == "cpu":
        if rec["arches"] != ["host"]:
            fail("a cpu module's arches must be [\"host\"]")
        if rec["abi"] != "host":
            fail("a cpu module's abi must be 'host'")
        if ".cu" in exts:
            fail("a cpu module cannot have .cu sources")
        if csize != 1 or rec["persistent_k"] != 0 or rec["smem_bytes"] != 0:
            fail("a cpu module needs cluster [1,1,1], persistent_k 0 and smem_bytes 0")
    else:
        if "host" in rec["arches"]:
            fail("a cuda module's arches are sm_XX targets, not 'host'")
        if rec["abi"] == "host":
            fail("abi 'host' is for cpu modules")
        if ".cu" not in exts:
            fail("a cuda module needs at least one .cu source")
        if rec["threads"] % 32:
            fail(f"threads {rec['threads']} is not a multiple of the warp size 32")
        if rec["state_dtype"] == "any":
            fail("state_dtype 'any' is for cpu modules; a cuda module is float32 or bfloat16")
        if csize > MAX_CLUSTER:
            fail(f"cluster {cluster} has {csize} CTAs; Hopper allows at most {MAX_CLUSTER}")
        if rec["smem_bytes"] * rec["min_blocks"] > MAX_SMEM_PER_SM:
            fail(f"smem_bytes {rec['smem_bytes']} x min_blocks {rec['min_blocks']} exceeds "
                 f"{MAX_SMEM_PER_SM} bytes of shared memory per SM")
        if rec["threads"] * rec["min_blocks"] > MAX_THREADS_PER_SM:
            fail(f"threads {rec['threads']} x min_blocks {rec['min_blocks']} exceeds "
                 f"{MAX_THREADS_PER_SM} threads per SM")
        if rec["abi"] in PERSISTENT_ABIS and rec["persistent_k"] == 0:
            fail(f"abi '{rec['abi']}' needs persistent_k > 0")
        if rec["abi"] in CLUSTER_ABIS and csize == 1:
            fail(f"abi '{rec['abi']}' needs a cluster of more than one CTA")
    if sup is not None and rec["state_dtype"] != "any" and sup["state_dtypes"] is not None \
            and rec["state_dtype"] not in sup["state_dtypes"]:
        fail(f"state_dtype '{rec['state_dtype']}' is not in jit/supported.json "
             f"{fam}/{backend} state_dtypes {sup['state_dtypes']}")
    for key in ("head_dims_k", "head_dims_v"):
        if sup is not None and sup[key] is not None and len(sup[key]) != 1:
            fail(f"jit/supported.json {fam}/{backend} {key} must be 'any' or one value "
                 f"(FKDA_HEAD_DIM_* hold one), not {sup[key]}")
    for flag in rec["flags"]:
        if flag.startswith(FORBIDDEN_FLAG_PREFIXES):
            fail(f"flag '{flag}' is set by the builder from the record's fields; remove it")
    upper = [k.upper() for k in rec["params"]]
    if len(set(upper)) != len(upper):
        fail("params names collide once upper-cased (FKDA_PARAM_<NAME>)")


class Registry:
    """All module records and routes of one data root."""

    def __init__(self, root: Path):
        self.root = root
        self.records: Dict[str, dict] = {}
        self.files: Dict[str, str] = {}  # record name -> spec file (relative to the root)
        self.routes: Dict[str, dict] = {}
        self.gb32_twin: Dict[str, str] = {}  # generated record -> its _gb32 twin (families.py)
        self.routed: set = set()       # names some rule can reach
        self.opt_in_tags: set = set()  # the names rules' "opt_in" use ($FLASHKDA_EXT_OPT_IN)
        self._load()

    def _load(self) -> None:
        jit, csrc = self.root / "jit", self.root / "csrc"
        for path in sorted((jit / "modules").glob("*.json")):
            fname = _rel(path, self.root)
            data = _read_json(path)
            _schema_check("modules", Path(fname), data, "modules")
            records, twin_of = families.expand_file(data)
            # a generated record meets the same schema as a plain one
            _schema_check("modules", Path(fname), {"description": data["description"], "modules": records},
                          "modules")
            self.gb32_twin.update(twin_of)
            for rec in records:
                _check_record(rec, fname, csrc, self.root)
                if rec["name"] in self.records:
                    raise SpecError(fname, rec["name"],
                                    f"name is not unique: also defined in {self.files[rec['name']]}")
                self.records[rec["name"]] = rec
                self.files[rec["name"]] = fname
        for path in sorted((jit / "routes").glob("*.json")):
            fname = _rel(path, self.root)
            data = _read_json(path)
            _schema_check("routes", Path(fname), data, "rules")
            data["rules"] = self._with_gb32_twins({**data, "rules": _with_opt_out_twins(data["rules"])}, fname)
            self._check_routes(data, fname, path.stem)
            self.routes[data["family"]] = data

    def _check_routes(self, data: dict, fname: str, stem: str) -> None:
        from .. import supported as _supported

        fam = data["family"]
        if stem != fam:
            raise SpecError(fname, None, f"routes file for family '{fam}' must be named {fam}.json")
        keys = META_KEYS[fam]
        backends = _supported.families(self.root).get(fam, [])
        fallback_for = set()
        seen = set()
        for rule in data["rules"]:
            rname = f"rule {rule['name']}"

            def fail(msg):
                raise SpecError(fname, rname, msg)

            if rule["name"] in seen:
                fail("rule names must be unique in a routes file (a _gb32 twin rule is generated: "
                     "do not write it)")
            seen.add(rule["name"])

            when = rule["when"]
            for k, v in when.items():
                base = k[:-4] if k.endswith(("_min", "_max")) else k
                if base not in keys:
                    fail(f"condition '{k}' is not route metadata of {fam} (known: {sorted(keys)})")
                if base != k and (base not in NUMERIC_META or not isinstance(v, int)
                                  or isinstance(v, bool)):
                    fail(f"range condition '{k}' needs a numeric key and an integer bound")
            devices = when.get("device", backends)
            devices = [devices] if isinstance(devices, str) else list(devices)
            for d in devices:
                if d not in backends:
                    fail(f"device '{d}' has no entry for {fam} in jit/supported.json")
                if d in fallback_for:
                    fail(f"unreachable: an earlier always-true rule already catches device '{d}'")
            opt_in = rule.get("opt_in")
            for d in devices:
                for name in self._expand(rule["module"], when, fam, d, fname, rname):
                    rec = self.records.get(name)
                    if rec is None:
                        fail(f"module '{name}' (from '{rule['module']}') is not defined in "
                             f"jit/modules")
                    if rec["family"] != fam or rec["backend"] != d:
                        fail(f"module '{name}' is {rec['family']}/{rec['backend']}, "
                             f"not {fam}/{d}")
                    # an opt-in module is reached by opt-in rules only; an opt-in rule may also send a call
                    # back to a default module (kda_prefill's exact_chain: the unsplit chain)
                    if rec.get("opt_in", False) and not opt_in:
                        fail(f"module '{name}' is marked opt_in in jit/modules, but the rule is not an "
                             f"opt-in rule")
                    self.routed.add(name)
            if opt_in:
                self.opt_in_tags.add(opt_in)
            elif set(when) <= {"device"}:
                fallback_for.update(devices)
        # every backend that has modules of this family must be reachable by a fallback
        served = {r["backend"] for r in self.records.values() if r["family"] == fam}
        missing = [b for b in sorted(served) if b not in fallback_for]
        if missing:
            raise SpecError(fname, None, f"no always-true fallback rule (when == {{\"device\": d}}) "
                                         f"for device(s) {missing}")

    def _with_gb32_twins(self, data: dict, fname: str) -> List[dict]:
        """The rules with, before each rule whose modules all have gb32 twins (families.py), its twin
        `<rule>_gb32`: the calls with fp32 g or beta (metadata gb = "f32") to the twin modules, in the
        same band. A rule that names `gb` itself is left as it is."""
        fam = data["family"]
        out = []
        for rule in data["rules"]:
            when = rule["when"]
            devices = when.get("device", [])
            devices = [devices] if isinstance(devices, str) else list(devices)
            names = [n for d in devices
                     for n in self._expand(rule["module"], when, fam, d, fname, f"rule {rule['name']}")]
            has = [n in self.gb32_twin for n in names if n in self.records]  # (a missing one: _check_routes)
            if "gb" not in when and names and any(has):
                if not all(has) or "gb" not in META_KEYS[fam]:
                    raise SpecError(fname, f"rule {rule['name']}",
                                    f"some of its modules have a gb32 twin and some not (or {fam} has no "
                                    f"'gb' metadata): a rule's modules need the same twin axes")
                twin = {"name": rule["name"] + families.GB32_SUFFIX, "when": {**when, "gb": "f32"},
                        "module": rule["module"] + families.GB32_SUFFIX,
                        "description": f"as {rule['name']}, for calls whose g or beta is fp32: the modules' "
                                       f"_gb32 twins read both as fp32 (params.gb_f32); the same band, not "
                                       f"measured apart"}
                if "opt_in" in rule:
                    twin["opt_in"] = rule["opt_in"]
                out.append(twin)
            out.append(rule)
        return out

    def _expand(self, pattern, when, fam, device, fname, rname) -> List[str]:
        """Every module name the pattern can produce for this device under the rule's conditions."""
        from .. import supported as _supported

        sup = _supported.supported(fam, device, self.root)
        states = [STATE_TAGS[d] for d in (sup["state_dtypes"] or STATE_TAGS)]
        values = {
            "state": states,
            "offset": list(OFFSET_TAGS.values()),
            "gate": sup["gates"] or ["softplus", "bounded", "log"],
            "slot_mode": sup["slot_modes"] or ["unique", "padded", "repeated"],
        }
        fields = [f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None]
        for f in fields:
            if f not in values:
                raise SpecError(fname, rname, f"module placeholder '{{{f}}}' is not one of "
                                              f"{sorted(values)}")
            if f in when:
                allowed = when[f] if isinstance(when[f], list) else [when[f]]
                values[f] = [v for v in values[f] if v in allowed]
        fields = sorted(set(fields))
        out = []
        for combo in itertools.product(*(values[f] for f in fields)):
            out.append(pattern.format(**dict(zip(fields, combo))))
        return out


def _fingerprint(root: Path) -> tuple:
    items = []
    for sub in ("jit/modules", "jit/routes", "jit"):
        d = root / sub
        try:
            with os.scandir(d) as it:
                for e in it:
                    if e.name.endswith(".json"):
                        st = e.stat()
                        items.append((sub, e.name, st.st_mtime_ns, st.st_size))
        except FileNotFoundError:
            pass
    return tuple(sorted(items))


_registries: Dict[str, tuple] = {}


def registry(root=None) -> Registry:
    r = roots.data_root(root)
    fp = _fingerprint(r)
    hit = _registries.get(str(r))
    if hit is not None and hit[0] == fp:
        return hit[1]
    if hit is not None:
        from .. import supported as _supported
        _supported.clear_cache()
    reg = Registry(r)
    _registries[str(r)] = (fp, reg)
    return reg


def get_record(name: str, root=None) -> dict:
    reg = registry(root)
    if name not in reg.records:
        raise KeyError(f"flashkda_ext: no JIT module named '{name}' in {reg.root / 'jit/modules'} "
                       f"(known: {', '.join(sorted(reg.records)) or 'none'})")
    return copy.deepcopy(reg.records[name])


def all_records(root=None) -> List[dict]:
    """Every record, in spec-file order."""
    return [copy.deepcopy(r) for r in registry(root).records.values()]


def record_file(name: str, root=None) -> str:
    return registry(root).files[name]


def opt_in_tags(root=None) -> frozenset:
    """The opt-in names the route rules declare (their "opt_in"; docs/jit.md, "Opt-in routes")."""
    return frozenset(registry(root).opt_in_tags)


def routes_for(family: str, root=None) -> List[dict]:
    """The ordered route rules of a family (jit/routes/<family>.json "rules")."""
    reg = registry(root)
    if family not in reg.routes:
        raise KeyError(f"flashkda_ext: no routes for family '{family}' "
                       f"(expected {reg.root / 'jit/routes' / (family + '.json')})")
    return copy.deepcopy(reg.routes[family]["rules"])


def _with_opt_out_twins(rules: List[dict]) -> List[dict]:
    """The rules with, before each rule that names an "opt_out" {"tag", "module"}, its twin `<rule>_<tag>`: an
    opt-in rule in the same band that sends the call to that module (the one the band had before the rule
    took it), so `$FLASHKDA_EXT_OPT_IN=<tag>` keeps it. The rule itself is passed on without the key."""
    out = []
    for rule in rules:
        rule = dict(rule)
        back = rule.pop("opt_out", None)
        if back is not None:
            out.append({"name": f"{rule['name']}_{back['tag']}", "when": dict(rule["when"]), "opt_in": back["tag"],
                        "module": back["module"],
                        "description": f"opt-in (FLASHKDA_EXT_OPT_IN={back['tag']}): {rule['name']}'s band on "
                                       f"the module it had before {rule['name']} took it"})
        out.append(rule)
    return out
