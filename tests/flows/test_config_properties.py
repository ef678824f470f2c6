"""Property tests for the config parser under hostile input: random YAML/JSON documents, valid
configs with one value mutated (wrong types, huge numbers, inf/nan, unicode and path-like
strings, unknown keys, node references), random `--set nodes.<name>.<key>` strings, random sweep
grids and DPO rounds, raw bytes. Every case ends in a valid config or in a ConfigError that names
the key path (or the file); never in another exception. Impossible parallel layouts and output
dirs outside the workspace (or shared by two nodes) are refused when the config loads, i.e. before
any process starts. The documents start from a fixed pipeline (tests/support/configs/pipeline.yaml, the demo's shape)."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from posttrain.core.config import ConfigError, _read, dump_config, from_json_file, load_config
from posttrain.core.parallel.config import ParallelConfig
from posttrain.flows.config import PipelineConfig
from posttrain.flows.dag import PipelineDAG, Upstream
from tests.support.pipelines import DEMO_CONFIG
from posttrain.stages.config import STAGE_CONFIGS, SFTConfig

SETTINGS = settings(max_examples=int(os.environ.get("HYPOTHESIS_EXAMPLES", 40)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
DEFAULT = dump_config(load_config(PipelineConfig, DEMO_CONFIG))  # the demo, every default written out
DEMO_DOC = _read(DEMO_CONFIG)  # the demo as written (shorthands: `model: student`, `data: prep`)
NODES = list(DEFAULT["nodes"])


def _leaves(node, path=()):
    if isinstance(node, dict) and node:
        for k, v in node.items():
            yield from _leaves(v, path + (k,))
    else:
        yield path


def _sections(node, path=()):
    if isinstance(node, dict):
        yield path
        for k, v in node.items():
            yield from _sections(v, path + (k,))


LEAVES = sorted(_leaves(DEFAULT))
SECTIONS = sorted(_sections(DEFAULT))
KEY_NAMES = sorted({p for path in LEAVES for p in path})

NASTY = ["", " ", "..", "../..", "../x", "/etc/passwd", "runs/../../x", "a/b", "~", "null", "~/x", "yes", "no",
         "on", "0x1F", "1e400", "-0", ".inf", ".nan", "\u202eevil", "ключ", "日本", "🤖", "a\tb", "a\nb",
         "a\x00b", "${HOME}", "$(id)", "*", "&a", "!!python/object:os.system", "%", "@", "`", "x" * 5000]
# what a node can name: nodes (also expanded ones), registered models, presets, kinds
REFS = [*NODES, "dpo@r1", "student@rank=8", "models:/m@champion", "models:/m/3", "models:/", "debug", "debug-moe",
        "data_prep", "sft", "nodes"]
TEXT = st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=12), st.sampled_from(NASTY))
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(-2**200, 2**200),
                   st.floats(), st.sampled_from([0, -1, 2**63, 2**64, 10**30, 1e308, float("inf"), float("nan")]),
                   TEXT, st.sampled_from(REFS))
KEY = st.one_of(st.sampled_from(KEY_NAMES), TEXT)
VALUE = st.recursive(SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEY, inner, max_size=3),
                     max_leaves=6)


def _write(text: str | bytes, suffix: str = ".yaml") -> Path:
    fd, name = tempfile.mkstemp(suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        f.write(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return Path(name)


def load_written(text: str | bytes, suffix: str = ".yaml"):
    """(the file, load(PipelineConfig, file)) for `text` written to a temporary file, removed again."""
    file = _write(text, suffix)
    try:
        return file, load(PipelineConfig, file)
    finally:
        file.unlink()


def load(cls, path=None, overrides=()):
    """The config, or the ConfigError; any other exception fails the test."""
    try:
        cfg = load_config(cls, path, overrides)
    except ConfigError as e:
        msg = str(e)
        assert msg.strip() and len(msg) < 20_000, msg[:500]
        event(f"ConfigError: {msg.split(':')[0][:30]}")
        return e
    event("valid")
    return cfg


def names_path(msg: str, path: tuple) -> bool:
    """The message names the key: a dotted prefix of it, and the key itself unless the prefix
    has two parts (a section's cross-field check names its fields in the text). A change to
    node X may also be refused where another node refers to X: then the message is about nodes
    and names X (`nodes.kd.model: 'X' is a sweep ...`, `nodes: a cycle X -> kd -> X`)."""
    path = tuple(str(p) for p in path)
    for k in range(len(path), 0, -1):
        if ".".join(path[:k]) in msg:
            if k >= 2 or len(path) == 1 or path[-1] in msg:
                return True
            break
    return len(path) >= 2 and path[0] == "nodes" and names_node(msg, path[1])


def names_node(msg: str, name: str) -> bool:
    if not name.isprintable():  # shown as its repr, on one line
        return f"nodes.{name!r}" in msg
    return any(line.startswith("nodes") and re.search(rf"(^|[\s'(.]){re.escape(name)}($|[\s'@,).:])", line)
               for line in msg.split("\n"))


def assert_usable(cfg: PipelineConfig) -> None:
    """What a valid config promises: it round-trips (as Prefect stores it), every node's spec
    builds with its inputs' outputs in place and round-trips as its stage's config, every node
    has a directory of its own inside the workspace, and its parallel layout fits its launcher's
    ranks."""
    again = PipelineConfig.model_validate(json.loads(json.dumps(dump_config(cfg))))
    assert dump_config(again) == dump_config(cfg)
    root = os.path.abspath(cfg.workspace)
    dag = PipelineDAG(cfg)
    assert sorted(dag.order) == sorted(dag.nodes) and {dag.nodes[n].base for n in dag.order} == set(cfg.nodes)
    dirs = set()
    for name in dag.order:
        assert all(dag.order.index(u) < dag.order.index(name) for u in dag.inputs(name))
        spec = dag.spec(name, {u: Upstream(str(dag.output_dir(u)), f"digest-{u}",
                                           "/picked" if dag.kind(u) == "evaluate" else None)
                               for u in dag.inputs(name)})
        assert type(STAGE_CONFIGS[dag.kind(name)].model_validate(json.loads(json.dumps(dump_config(spec))))) \
            is type(spec)
        out = os.path.abspath(spec.output_dir)
        assert os.path.commonpath([root, out]) == root, (name, spec.output_dir)
        assert not any(out == d or out.startswith(d + os.sep) or d.startswith(out + os.sep) for d in dirs), name
        dirs.add(out)
        if hasattr(spec, "parallel"):
            spec.parallel.resolve(spec.launcher.nnodes * spec.launcher.nproc_per_node)


def _set_in(doc: dict, path: tuple, value) -> None:
    node = doc
    for p in path[:-1]:
        node = node[p]
    node[path[-1]] = value


def _round_trips(text: str, doc) -> bool:
    from posttrain.core.config import _Yaml12Loader

    try:
        back = yaml.load(text, Loader=_Yaml12Loader)
        return json.dumps(back, sort_keys=True, default=repr) == json.dumps(doc, sort_keys=True, default=repr)
    except (yaml.YAMLError, TypeError, ValueError):
        return False


@st.composite
def mutation(draw):
    """The default config with one change: a value replaced, a key added or removed."""
    doc = json.loads(json.dumps(DEFAULT))
    kind = draw(st.sampled_from(["replace", "replace", "replace", "add", "remove"]))
    if kind == "add":
        section = draw(st.sampled_from(SECTIONS))
        key = draw(KEY)
        path = section + (key,)
        node = doc
        for p in section:
            node = node[p]
        if key in node:
            return doc, None
        node[key] = draw(VALUE)
    else:
        path = draw(st.sampled_from(LEAVES))
        if kind == "remove":
            node = doc
            for p in path[:-1]:
                node = node[p]
            del node[path[-1]]
        else:
            _set_in(doc, path, draw(VALUE))
    return doc, path


@SETTINGS
@given(change=mutation(), as_json=st.booleans())
def test_one_bad_value_is_named_by_its_key_path(change, as_json):
    doc, path = change
    text = yaml.safe_dump(doc, allow_unicode=True)
    if not as_json and not _round_trips(text, doc):
        as_json = True  # e.g. a key `0e0`: PyYAML writes it unquoted (YAML 1.1), YAML 1.2 reads a float
        event("YAML written differs from the document; sent as JSON")
    suffix = ".json" if as_json else ".yaml"
    text = json.dumps(doc) if as_json else text
    file, got = load_written(text, suffix)
    if isinstance(got, ConfigError):
        msg = str(got)
        assert path is not None and (names_path(msg, path) or msg.startswith(f"{file}: ")), (path, msg)
    else:
        assert_usable(got)


@SETTINGS
@given(doc=st.dictionaries(KEY, VALUE, max_size=4),
       nest=st.sampled_from([(), ("nodes",), ("nodes", "distill"), ("nodes", "evaluate"), ("launcher",)]))
def test_random_documents(doc, nest):
    """A random document, alone (no nodes) or written into a section of the demo as the user wrote it."""
    if nest:
        full = json.loads(json.dumps(DEMO_DOC))
        section = full
        for p in nest:
            section = section[p]
        section.update(doc)
        doc = full
    try:
        text = yaml.safe_dump(doc, allow_unicode=True)
    except yaml.YAMLError:  # e.g. a key yaml cannot represent: not a document a user can write
        return
    file, got = load_written(text)
    if isinstance(got, ConfigError):
        assert str(file) in str(got), str(got)  # which file, and (per line) which key
    else:
        assert_usable(got)


@settings(SETTINGS, max_examples=30)
@given(raw=st.one_of(st.binary(max_size=200), st.text(max_size=200),
                     st.sampled_from(["a: " + "[" * 500, "{" * 100 + "}" * 100, "- 1", "1: 2", "null", "!!binary x",
                                      "a: &a [1,1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
                                      "c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
                                      "e: [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\n",
                                      "name: a\nname: b\n", "nodes:\n  s:\n    max_steps: " + "9" * 5000,
                                      "nodes:\n  s: {kind: sft, model: s, data: s}\n",
                                      "nodes:\n  p: {kind: data_prep}\n  s: {kind: sft, data: p, sweep: {seed: [1, 2]}}\n"])),
       suffix=st.sampled_from([".yaml", ".json"]))
def test_raw_bytes_and_text(raw, suffix):
    file, got = load_written(raw, suffix)
    if isinstance(got, ConfigError):
        assert str(file) in str(got), str(got)
    else:
        assert_usable(got)


SET_KEYS = st.one_of(st.sampled_from([".".join(p) for p in LEAVES]), st.sampled_from([".".join(p) for p in SECTIONS if p]),
                     st.builds(lambda a, b: f"{a}.{b}", st.sampled_from([".".join(p) for p in LEAVES]), TEXT), TEXT)
SET_VALUES = st.one_of(TEXT, VALUE.map(lambda v: json.dumps(v)), st.sampled_from(["[", "{a: ", "!!python/name:os.system",
                                                                                 "&x [*x]", "9" * 5000, "a: b: c"]))


@SETTINGS
@given(sets=st.lists(st.tuples(SET_KEYS, st.sampled_from(["=", "=", "", "=="]), SET_VALUES), min_size=1, max_size=3))
def test_random_set_overrides(sets):
    items = [f"{k}{eq}{v}" for k, eq, v in sets]
    got = load(PipelineConfig, DEMO_CONFIG, items)
    if isinstance(got, ConfigError):
        msg = str(got)
        keys = [k.strip() for k, eq, _ in sets]
        assert (any(names_path(msg, tuple(k.split("."))) for k in keys) or any(k and f"--set {k}" in msg for k in keys)
                or any(i in msg or repr(i) in msg for i in items)), (items, msg)
    else:
        assert_usable(got)


def _shape(node: str):
    """(heads, kv heads, experts) of the model node `node` trains in the demo (None: evaluate)."""
    dag = PipelineDAG(load_config(PipelineConfig, DEMO_CONFIG))
    return dag.model_shape(dag.members[node][0])  # the dpo node runs in rounds: its first


SHAPES = {n: _shape(n) for n in ("teacher", "distill", "dpo", "evaluate")}


@SETTINGS
@given(sizes=st.fixed_dictionaries({k: st.sampled_from([1, 1, 2, 3, 4]) for k in ("dp_replicate", "tp", "pp", "cp", "ep")}),
       dp_shard=st.sampled_from([-1, -1, 1, 2, 3]), nproc=st.integers(1, 8), nnodes=st.integers(1, 3),
       node=st.sampled_from(["teacher", "distill", "dpo", "evaluate"]), own_launcher=st.booleans())
def test_impossible_parallel_layouts_are_refused_at_load(sizes, dp_shard, nproc, nnodes, node, own_launcher):
    kind = "local" if nnodes == 1 else "multinode"
    launcher = f"nodes.{node}.launcher" if own_launcher else "launcher"  # the node's own, or the pipeline's
    sets = [f"nodes.{node}.parallel.{k}={v}" for k, v in sizes.items()] + [
        f"nodes.{node}.parallel.dp_shard={dp_shard}", f"{launcher}.nproc_per_node={nproc}",
        f"{launcher}.nnodes={nnodes}", f"{launcher}.kind={kind}", f"{launcher}.rdzv_endpoint=head:29500"]
    # the demo's other nodes ask for DDP over 2 ranks: let them fill whatever world the launcher gives
    sets += [f"nodes.{other}.parallel.dp_replicate=1" for other in ("teacher", "student", "distill", "dpo")
             if other != node]
    if sizes["pp"] > 1:
        sets.append(f"nodes.{node}.parallel.pp_microbatches={sizes['pp']}")
    got = load(PipelineConfig, DEMO_CONFIG, sets)
    layout = ParallelConfig(**sizes, dp_shard=dp_shard, pp_microbatches=sizes["pp"] if sizes["pp"] > 1 else None)
    fits = world_fits = True  # the layout fits the launcher's world; and also the node's model
    try:
        layout.resolve(nproc * nnodes)
    except ValueError:
        fits = world_fits = False
    try:
        if world_fits and SHAPES[node] is not None:  # the model the node trains, traced back to its preset
            layout.validate_for_model(*SHAPES[node])
    except ValueError:
        fits = False
    refused = None  # the key the stage's own check names
    if sizes["pp"] > 1:
        if node in ("teacher", "distill", "dpo"):  # the training stages run pp: posttrain.stages.config's checks in order
            cp, tp, data = sizes["cp"], sizes["tp"], DEFAULT["nodes"][node]["data"]
            sp = tp if tp > 1 else 1  # (sequence parallelism is on by default)
            if cp > 1 and data["max_seq_len"] % (2 * cp * sp):  # rows cut into 2 x cp (x tp) chunks
                refused = "data.max_seq_len"
            elif data["batch_tokens"] is not None:  # the demo's batch_tokens: pp runs fixed shapes
                refused = "data.batch_tokens"
            elif data["micro_batch_size"] % sizes["pp"]:  # the rows of a micro-batch, cut into pp microbatches
                refused = "data.micro_batch_size"
            elif data["max_seq_len"] % sp:  # rows split by sequence over tp
                refused = "data.max_seq_len"
        elif sizes["ep"] > 1:  # evaluation: stages x tp (x dp_shard / cp sharding), not ep
            refused = "parallel.ep"
    # the stage's own check comes first, unless the node's own launcher's world does not fit it (the
    # model's shape is checked after both)
    if refused and (world_fits or not own_launcher):
        assert isinstance(got, ConfigError) and f"nodes.{node}." in str(got), str(got)
        assert fits is False or f"nodes.{node}.{refused}: " in str(got), str(got)
    elif refused:
        assert isinstance(got, ConfigError) and f"nodes.{node}.parallel" in str(got), str(got)
    elif fits:
        assert isinstance(got, PipelineConfig), str(got)
        assert_usable(got)
    else:
        assert isinstance(got, ConfigError) and f"nodes.{node}.parallel: " in str(got), str(got)
        assert "(from --set nodes." in str(got) or "(from --set launcher." in str(got), str(got)


@settings(SETTINGS, max_examples=25)
@given(out=st.one_of(TEXT, st.sampled_from(NODES + ["student/x", "x/..", ".locks", "."]),
                     st.builds(os.path.join, st.sampled_from(["..", "/", "/tmp", "a", ".", "dpo"]), TEXT)),
       node=st.sampled_from(NODES), rounds=st.sampled_from([1, 1, 3]))
def test_output_dirs_never_escape_the_workspace(out, node, rounds):
    got = load(PipelineConfig, DEMO_CONFIG, [f"nodes.{node}.output_dir={json.dumps(out)}", f"nodes.dpo.rounds={rounds}",
                                             "nodes.evaluate.models=[dpo, distill]"])  # (the demo names dpo@r1)
    if isinstance(got, ConfigError):
        assert f"nodes.{node}.output_dir" in str(got), str(got)
    else:
        assert_usable(got)  # includes: every node's dir lies inside the workspace, apart from the others


SWEEP_KEYS = {"lora.rank": st.one_of(st.integers(1, 64), st.sampled_from([0, -1, 2**40])),
              "optim.lr": st.one_of(st.floats(1e-6, 1.0), st.sampled_from([0.0, -1.0, float("nan"), float("inf")])),
              "seed": st.one_of(st.integers(0, 99), st.sampled_from([-1, 2**64])),
              "max_steps": st.one_of(st.integers(1, 500), st.none()),
              "model.name_or_path": st.sampled_from(REFS + ["a/b"]), "lora.targets": st.lists(TEXT, max_size=2),
              "data.sources": st.lists(st.sampled_from(REFS), min_size=1, max_size=2), "kind": st.sampled_from(["sft", "dpo"]),
              "nope.x": SCALAR, "optim.lr.x": SCALAR}
COMMON = ["lora.rank", "optim.lr", "seed", "max_steps"]  # drawn most often: mostly valid grids


@st.composite
def sweep(draw):
    keys = draw(st.lists(st.sampled_from(COMMON * 6 + sorted(SWEEP_KEYS)), min_size=1, max_size=3, unique=True))
    return {k: draw(st.lists(SWEEP_KEYS[k], min_size=0 if draw(st.integers(0, 9)) == 0 else 1, max_size=3,
                             unique_by=None if draw(st.integers(0, 4)) == 0 else json.dumps))
            for k in keys}


@settings(SETTINGS, max_examples=60)
@given(grid=sweep(), node=st.sampled_from(["student", "student", "dpo", "dpo", "prep"]), rounds=st.sampled_from([1, 1, 2, 3, 0]),
       evaluated=st.lists(st.sampled_from(["student", "dpo", "dpo@r1", "teacher"] * 3 + REFS), min_size=1, max_size=3))
def test_random_sweeps_and_rounds(grid, node, rounds, evaluated):
    """A sweep over a node of the demo, the DPO node in rounds, and evaluate naming anything: a valid
    config expands into the grid (each member's settings its own values), a chain of rounds each
    reading the one before; anything else is refused naming a node."""
    sets = [f"nodes.{node}.sweep={json.dumps(grid)}", f"nodes.dpo.rounds={rounds}",
            f"nodes.evaluate.models={json.dumps(evaluated)}", "nodes.distill.model=teacher"]
    got = load(PipelineConfig, DEMO_CONFIG, sets)
    if isinstance(got, ConfigError):
        msg = str(got)
        assert msg.startswith("nodes"), msg
        assert all(line.startswith("nodes") and ("(from --set" in line or "pipeline.yaml" in line)
                   for line in msg.split("\n")), msg
        return
    assert_usable(got)
    dag = PipelineDAG(got)
    members = dag.members[node]
    assert len(members) == math.prod(len(v) for v in grid.values())
    assert len(set(members)) == len(members) and all(m.startswith(f"{node}@") and "/" not in m for m in members)
    chain = [n for n in dag.order if dag.nodes[n].base == "dpo"]
    assert len(chain) == len(dag.members["dpo"]) * rounds
    for n in chain:
        if n.endswith("@r1") or rounds == 1:
            continue
        prev = n.rsplit("@r", 1)[0] + f"@r{int(n.rsplit('@r', 1)[1]) - 1}"
        assert prev in dag.inputs(n) and dag.nodes[n].cfg.model.name_or_path == prev


@SETTINGS
@given(doc=st.dictionaries(KEY, VALUE, max_size=5))
def test_stage_spec_json(doc):
    """The JSON spec a torchrun entry point reads (from_json_file), with NaN/Infinity allowed."""
    file = _write(json.dumps(doc), ".json")
    try:
        got = from_json_file(SFTConfig, file)
        event("valid")
    except ConfigError as e:
        assert str(file) in str(e)
        event("ConfigError")
    finally:
        file.unlink()


OLD_STAGES = ["data_prep", "sft_teacher", "sft_student", "distill", "dpo", "evaluate"]
OLD_REF = st.one_of(st.sampled_from(OLD_STAGES + [None]), SCALAR)


@st.composite
def old_document(draw):
    """An old fixed-chain config: stages switched on and off, references between them (cycles and
    all), settings sections or anything else."""
    doc = {}
    if draw(st.booleans()):
        doc["stages"] = draw(st.one_of(st.dictionaries(st.sampled_from(OLD_STAGES), st.booleans()), VALUE))
    for stage in draw(st.lists(st.sampled_from(OLD_STAGES), unique=True, max_size=4)):
        sec = draw(st.one_of(st.fixed_dictionaries({}, optional={
            "init_from": OLD_REF, "teacher_from": OLD_REF, "max_steps": st.integers(-1, 5),
            "compare_to": st.one_of(st.lists(OLD_REF, max_size=3), SCALAR), "model": st.one_of(VALUE, st.just({})),
            "kind": st.sampled_from(["forward_kl", "jsd", "x"]), "data": st.one_of(st.just({}), VALUE)}), SCALAR))
        doc[stage] = sec
    return doc


@settings(SETTINGS, max_examples=60)
@given(old=old_document())
def test_converting_any_old_document(old):
    """`posttrain config --convert OLD.yaml`: a DAG-format document, or a ConfigError naming the
    file; the converted document loads as a config or a ConfigError (never a crash or a hang)."""
    from posttrain.flows.convert import convert_file

    file = _write(json.dumps(old), ".json")
    try:
        try:
            text = convert_file(file)
        except ConfigError as e:
            assert str(file) in str(e), str(e)
            event("refused by the converter")
            return
    finally:
        file.unlink()
    new = yaml.safe_load(text)
    assert set(new["nodes"]) <= set(OLD_STAGES) and not set(new) & (set(OLD_STAGES) | {"stages"})
    _, got = load_written(text)
    if isinstance(got, PipelineConfig):
        assert_usable(got)


def test_impossible_layout_stops_the_cli_before_any_launch(monkeypatch, capsys):
    import posttrain.stages.launch
    from posttrain.flows.cli import main

    def no_launch(*a, **k):
        raise AssertionError("a process was launched")

    monkeypatch.setattr(posttrain.stages.launch, "launch_stage", no_launch)
    assert main(["stage", "sft", "--set", "parallel.tp=3"]) == 2  # the default launcher: 2 ranks
    assert "config error: parallel: world size 2 is not divisible" in capsys.readouterr().err
    assert main(["config", "--set", "nodes.dpo.parallel.cp=4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("config error: nodes.dpo.parallel: world size 2") and "(from --set nodes.dpo.parallel.cp=4)" in err
    assert main(["run", "--set", "nodes.dpo.parallel.cp=4"]) == 2  # refused before the flow starts
    assert "config error: nodes.dpo.parallel: world size 2" in capsys.readouterr().err
    assert main(["run", "--set", "nodes.evaluate.parallel.pp=2", "--set", "nodes.evaluate.parallel.ep=2"]) == 2
    assert "config error: nodes.evaluate.parallel.ep: evaluation under pipeline" in capsys.readouterr().err
    assert main(["run", "--set", "nodes.student.parallel.pp=2"]) == 2  # SFT runs pp, on fixed shapes only
    assert "config error: nodes.student.data.batch_tokens: pipeline parallelism" in capsys.readouterr().err
    assert main(["config", "--set", "nodes.teacher.output_dir=../../elsewhere"]) == 2
    assert "nodes.teacher.output_dir" in capsys.readouterr().err


@pytest.mark.parametrize("text, where", [
    ("name: a\nname: b\n", "duplicate key 'name'"),
    ("nodes:\n  a: {kind: sft}\n  a: {kind: dpo}\n", "duplicate key 'a'"),
    # whichever refuses first: the YAML parser at the interpreter's recursion limit, or the depth check
    # after it (something imported earlier in the session may have raised that limit)
    ("a: " + "[" * 500 + "]" * 500, "not valid YAML: maximum recursion depth|nested more than 64 levels deep"),
    ("a: " + "[" * 100 + "]" * 100, "nested more than 64 levels deep"),
    ("nodes:\n  s:\n    max_steps: " + "9" * 5000, "not valid YAML"),
    ("x: &a [1,1,1,1,1,1,1,1,1,1]\n" + "".join(f"x{i}: &a{i} [{', '.join(['*a' if i == 0 else f'*a{i - 1}'] * 10)}]\n"
                                                for i in range(6)), "YAML aliases expanded"),
    ("nodes:\n  s: {kind: sft, sweep: {seed: &a [1,1,1,1,1,1,1,1,1,1], epochs: *a, max_steps: *a, eval_interval: *a}}\n",
     "is listed twice"),
])
def test_hostile_yaml_shapes(text, where):
    file = _write(text)
    try:
        with pytest.raises(ConfigError, match=where):
            load_config(PipelineConfig, file)
    finally:
        file.unlink()


def test_not_utf8_and_nul_bytes(tmp_path):
    (tmp_path / "c.yaml").write_bytes(b"name: \xff\xfe")
    with pytest.raises(ConfigError, match="c.yaml: not UTF-8 text"):
        load_config(PipelineConfig, tmp_path / "c.yaml")
    for item in ['nodes.teacher.output_dir="a\\0b"', 'nodes.prep.sources=["x\\0"]', 'tracking.tags={"a": "b\\0"}',
                 'nodes.student.model="x\\0"', 'nodes.evaluate.models=["dpo", "\\0"]', 'nodes.student.sweep={"seed\\0": [1]}']:
        with pytest.raises(ConfigError, match="contains a NUL byte"):
            load_config(PipelineConfig, DEMO_CONFIG, [item])
    with pytest.raises(ConfigError, match=r"^nodes.teacher.output_dir: is not valid Unicode \(a lone surrogate\)"):
        load_config(PipelineConfig, DEMO_CONFIG, ['nodes.teacher.output_dir="\\ud800\\udc00"'])
