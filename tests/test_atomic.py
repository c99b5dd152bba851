"""slimopt.atomic, the one way slimopt writes a file or folder: whole or not at all, no temporary left behind."""

from __future__ import annotations

import os

import pytest

from slimopt.atomic import atomic_dir, atomic_file, atomic_path, replace_dir, write_atomic


def test_a_write_replaces_the_file_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "sub" / "a.json"
    write_atomic(path, "old")
    write_atomic(path, "new\n")
    assert path.read_text() == "new\n" and os.listdir(path.parent) == ["a.json"]
    write_atomic(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"


def test_an_interrupted_write_keeps_the_previous_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / "a.txt"
    write_atomic(path, "old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_file(path, "w") as f:
            f.write("half")
            raise KeyboardInterrupt
    with pytest.raises(RuntimeError):
        with atomic_path(path, suffix=".so"):
            raise RuntimeError("the compiler failed")
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["a.txt"]


def test_files_get_the_permissions_open_would_give(tmp_path):
    umask = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a", "x")
        with atomic_dir(tmp_path / "d"):
            pass
    finally:
        os.umask(umask)
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755


def test_a_folder_appears_whole_once(tmp_path):
    target = tmp_path / "data"
    with atomic_dir(target) as tmp:
        (tmp / "x").write_text("1")
        assert not target.exists()
    assert (target / "x").read_text() == "1"
    with pytest.raises(FileExistsError):  # another process finished first: its folder stays
        with atomic_dir(target) as tmp:
            (tmp / "x").write_text("2")
    with pytest.raises(ValueError):
        with atomic_dir(tmp_path / "never") as tmp:
            raise ValueError
    assert (target / "x").read_text() == "1" and os.listdir(tmp_path) == ["data"]


def test_replacing_a_folder_keeps_the_old_one_until_the_new_one_is_in_place(tmp_path, monkeypatch):
    final = tmp_path / "ckpt"
    with atomic_dir(final, replace=True) as tmp:
        (tmp / "v").write_text("1")
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "v").write_text("2")
    real = os.replace

    def crash_on_the_second(src, dst):
        if str(src) == str(staged):
            raise OSError("killed between the two renames")
        real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_the_second)
    with pytest.raises(OSError):
        replace_dir(staged, final)
    assert (tmp_path / "ckpt.old" / "v").read_text() == "1"  # what find_checkpoint falls back to
    monkeypatch.undo()
    replace_dir(staged, final)
    assert (final / "v").read_text() == "2" and sorted(os.listdir(tmp_path)) == ["ckpt"]
