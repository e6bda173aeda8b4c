"""An S3 DVC remote (dvc-s3) against a moto S3 server that the test starts on 127.0.0.1 and stops: the tiny
pipeline's outs are `dvc push`ed from one git repo, a fresh `git clone` of it `dvc pull`s them, and there
`dvc status` is clean, `dvc repro` runs no stage and every pulled file equals the original byte for byte.
The remote (bucket, endpoint, region) is committed in `.dvc/config`; the credentials live only in each
checkout's git-ignored `.dvc/config.local`. Nothing reaches an address other than 127.0.0.1, and the user's
own AWS configuration and credentials are never read. Slow (minutes: one tiny `dvc repro`):
`pytest -m slow tests/integration/test_dvc_remote.py`."""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.integration.test_real_pipeline_dvc import GIT, dvc, ran, sh, tiny_repo

pytestmark = pytest.mark.slow

BUCKET = "codi-trace-test"
REMOTE = "team"
REGION = "us-east-1"
# Fake credentials, moto accepts any. Made at run time: the repository under test is a copy of this project,
# this file included, so a literal here would be "committed" there and defeat the no-credential check.
KEY_ID = "AKIA" + secrets.token_hex(8).upper()
SECRET = secrets.token_hex(20)  # hex: never starts with "-", which the dvc CLI would read as an option


@pytest.fixture
def s3(tmp_path, monkeypatch) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (a free port) holding one empty bucket; yields its endpoint URL and is
    stopped when the test ends, passed or failed. The AWS environment is emptied for the test's
    subprocesses: no credentials, profile or endpoint from the user's environment, and the AWS config and
    credentials files point at paths that do not exist (not /dev/null: dvc-s3 reads AWS_CONFIG_FILE itself
    when the path exists, and botocore refuses a path that is not a regular file)."""
    import boto3
    from moto.server import ThreadedMotoServer

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                "AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3",
                "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    absent = tmp_path / "no-aws"
    monkeypatch.setenv("AWS_CONFIG_FILE", str(absent / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(absent / "credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata lookup for credentials
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    monkeypatch.setenv("no_proxy", "127.0.0.1")

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        client = boto3.client("s3", endpoint_url=url, region_name=REGION,
                              aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET)
        client.create_bucket(Bucket=BUCKET)
        yield url
    finally:
        server.stop()
        if server._server is not None:
            server._server.server_close()  # stop() ends serving but leaves the socket bound


def credentials(checkout: Path) -> None:
    """The remote's credentials for one checkout: `.dvc/config.local`, which git ignores."""
    dvc(checkout, "remote", "modify", "--local", REMOTE, "access_key_id", KEY_ID)
    dvc(checkout, "remote", "modify", "--local", REMOTE, "secret_access_key", SECRET)


def cached_outs(repo: Path) -> list[str]:
    """The outs of dvc.yaml that DVC caches, and so pushes and pulls (`cache: false` ones are committed to git)."""
    outs = []
    for stage in yaml.safe_load((repo / "dvc.yaml").read_text())["stages"].values():
        for out in stage.get("outs", []):
            path, opts = (out, {}) if isinstance(out, str) else next(iter(out.items()))
            if opts.get("cache", True):
                outs.append(path)
    return outs


def files_under(root: Path, outs: list[str]) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for out in outs:
        path = root / out
        for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
            found[f.relative_to(root).as_posix()] = f.read_bytes()
    return found


def test_push_then_pull_into_a_fresh_clone_restores_the_pipeline(tmp_path, s3):
    import boto3

    repo = tiny_repo(tmp_path / "repo")

    # the team's remote, committed: bucket, S3-compatible endpoint, region; no secret
    dvc(repo, "remote", "add", "-d", REMOTE, f"s3://{BUCKET}/codi-trace")
    dvc(repo, "remote", "modify", REMOTE, "endpointurl", s3)
    dvc(repo, "remote", "modify", REMOTE, "region", REGION)
    credentials(repo)
    sh(repo, "git", "add", "-A")
    sh(repo, *GIT, "commit", "-qm", "S3 remote")
    committed = sh(repo, "git", "show", "HEAD:.dvc/config")
    assert f"s3://{BUCKET}/codi-trace" in committed and s3 in committed
    assert KEY_ID not in committed and SECRET not in committed
    assert "access_key" not in committed and "secret" not in committed
    assert SECRET in (repo / ".dvc/config.local").read_text()
    sh(repo, "git", "check-ignore", "-q", ".dvc/config.local")  # exit 0: ignored
    assert ".dvc/config.local" not in sh(repo, "git", "ls-files").split()
    assert sh(repo, "git", "status", "--porcelain") == ""
    found = subprocess.run(["git", "grep", "-l", "-F", "-e", KEY_ID, "-e", SECRET, "HEAD"], cwd=repo,
                           capture_output=True, text=True)
    assert found.returncode == 1 and found.stdout == "", found.stdout  # in no committed file

    pushed = dvc(repo, "push")
    assert "pushed" in pushed, pushed
    assert f"Cache and remote '{REMOTE}' are in sync." in dvc(repo, "status", "--cloud")
    client = boto3.client("s3", endpoint_url=s3, region_name=REGION,
                          aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET)
    keys = [o["Key"] for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
            for o in page.get("Contents", [])]
    assert keys and all(k.startswith("codi-trace/files/md5/") for k in keys), keys[:5]

    clone = tmp_path / "clone"
    sh(tmp_path, "git", "clone", "-q", str(repo), str(clone))
    assert not (clone / ".dvc/config.local").exists()  # credentials do not travel with the repository
    assert not (clone / "models").exists() and not (clone / "data/cache").exists()
    credentials(clone)
    dvc(clone, "pull")

    assert "Data and pipelines are up to date." in dvc(clone, "status")
    assert ran(dvc(clone, "repro")) == []
    outs = cached_outs(repo)
    assert {"data/traces", "data/cache/manifest.json", "models/base", "models/codi"} <= set(outs), outs
    original, pulled = files_under(repo, outs), files_under(clone, outs)
    assert "data/cache/manifest.json" in pulled and any(f.startswith("models/codi/") for f in pulled)
    assert sorted(pulled) == sorted(original)
    assert [f for f in original if original[f] != pulled[f]] == []
