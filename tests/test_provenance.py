"""Provenance: the commit a run starts from, and whether its code differs from it."""

import subprocess

from tfmem.cli import provenance


def _git(repo, *argv):
    subprocess.run(["git", "-C", str(repo), *argv], check=True, capture_output=True)


def test_a_changed_result_file_is_not_uncommitted_code(tmp_path, monkeypatch):
    results = tmp_path / provenance.RESULTS
    results.mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (results / "run.json").write_text("{}\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    clean = provenance.source()
    assert len(clean["commit"]) == 40 and clean["commit_dirty"] is False
    # One run of a series wrote its result: the next one still runs committed code.
    (results / "run.json").write_text('{"result": 1}\n')
    assert provenance.source()["commit_dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance.source()["commit_dirty"] is True
