"""`sits serve`'s audit flags: a bad key file or a checkpoint file without a log is refused
(exit 2) before the model loads."""

from __future__ import annotations

from pathlib import Path

from sits.cli.main import main

SECRET = b"the auditor's secret, 32 bytes.."


def test_serve_refuses_a_bad_key_file_before_the_model_loads(tmp_path: Path, capsys) -> None:
    log = str(tmp_path / "audit.log")
    key_file = tmp_path / "audit.key"
    key_file.write_bytes(SECRET)
    key_file.chmod(0o644)
    assert main(["serve", "--audit-log", log, "--audit-key-file", str(key_file)]) == 2
    err = capsys.readouterr().err
    assert "the audit key file" in err and "open to other users (mode 0644)" in err
    assert main(["serve", "--audit-log", log, "--audit-key-file", str(tmp_path / "no")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["serve", "--audit-checkpoint-file", str(tmp_path / "cp")]) == 2
    assert "--audit-checkpoint-file needs --audit-log" in capsys.readouterr().err
    assert not Path(log).exists()  # nothing was opened
