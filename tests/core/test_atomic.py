"""posttrain.core.atomic: whole files or none, private modes for secrets, and the directory swap."""

from __future__ import annotations

import json
import os
import stat

import pytest

from posttrain.core.atomic import replace_dir, write_json_atomic


def test_json_is_replaced_whole_with_the_mode_asked_for(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text("old")
    os.chmod(path, 0o644)
    old_umask = os.umask(0)  # a permissive umask must not widen a secret's mode
    try:
        write_json_atomic(path, {"b": 1, "a": [1, 2]}, mode=0o600)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text() == json.dumps({"a": [1, 2], "b": 1}, indent=2) + "\n"  # sorted, indented
    write_json_atomic(path, {"x": 1}, indent=None)
    assert path.read_text() == '{"x": 1}\n'
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~old_umask  # as open() would create it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.json"]


def test_a_value_json_refuses_leaves_the_old_file_and_no_temp(tmp_path):
    path = tmp_path / "m.json"
    write_json_atomic(path, {"ok": True})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"ok": True}
    write_json_atomic(path, {"p": tmp_path}, default=str)
    assert json.loads(path.read_text()) == {"p": str(tmp_path)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json"]


def test_replace_dir_swaps_in_the_new_directory(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    for content in ("new", "newer"):
        tmp = tmp_path / ".out.tmp"
        tmp.mkdir()
        (tmp / "f.txt").write_text(content)
        replace_dir(tmp, tmp_path / "out")
        assert [p.name for p in (tmp_path / "out").iterdir()] == ["f.txt"]
        assert (tmp_path / "out" / "f.txt").read_text() == content
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
