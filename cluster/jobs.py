"""Submitting a training job to a running Ray cluster through Ray's Jobs API.

The project directory travels as the job's working dir, with the resolved
config written into a copy of it, so the cluster runs exactly what was
submitted. Token authentication stays on: the token comes from
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or Ray's token file, and is never
printed or written anywhere by nestor.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cluster.launcher import PROJECT_ROOT, UPLOAD_EXCLUDES
from cluster.rendezvous import ClusterError

SUBMITTED_CONFIG = ".nestor/config.yaml"
TOKEN_FILE = Path.home() / ".ray" / "auth_token"


def _use_token_if_present() -> None:
    """Turns on Ray's token auth for this client when a token is available (env or file)."""
    if os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH") or TOKEN_FILE.exists():
        os.environ.setdefault("RAY_AUTH_MODE", "token")


def client(address: str):
    """Returns a JobSubmissionClient for `address`.

    Raises ClusterError with one line when nothing answers there.
    """
    _use_token_if_present()  # before Ray's import: Ray reads the auth mode once
    from ray.job_submission import JobSubmissionClient

    try:
        return JobSubmissionClient(address)
    except Exception as error:  # Ray raises ConnectionError, RuntimeError or ValueError here
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ClusterError(f"--address {address}: no Ray cluster answers there ({reason[:200]}); "
                           "start one with `ray start --head` or pass its dashboard URL, e.g. "
                           "http://127.0.0.1:8265") from None


def submit(address: str, config_yaml: str, command: str = "train") -> str:
    """Submits `nestor <command>` on `config_yaml` (resolved config text); returns the submission id.

    Raises ClusterError when the cluster cannot be reached.
    """
    jobs = client(address)
    with tempfile.TemporaryDirectory(prefix="nestor-submit-") as staging:
        working_dir = Path(staging) / "project"
        shutil.copytree(PROJECT_ROOT, working_dir, ignore=shutil.ignore_patterns(
            *(pattern.split("/")[-1] for pattern in UPLOAD_EXCLUDES)))
        (working_dir / SUBMITTED_CONFIG).parent.mkdir(exist_ok=True)
        (working_dir / SUBMITTED_CONFIG).write_text(config_yaml)
        return jobs.submit_job(
            entrypoint=f"python -m orchestrator.cli {command} {SUBMITTED_CONFIG}",
            runtime_env={"working_dir": str(working_dir)},
        )


def follow(address: str, job_id: str, out=sys.stdout) -> str:
    """Streams the job's logs to `out` until it ends; returns its final status (SUCCEEDED, FAILED, STOPPED)."""
    jobs = client(address)

    async def stream():
        async for lines in jobs.tail_job_logs(job_id):
            out.write(lines)
            out.flush()

    asyncio.run(stream())
    return str(jobs.get_job_status(job_id).value)


def status(address: str, job_id: str) -> str:
    """Returns the job's status name (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED).

    Raises ClusterError when the cluster is unreachable or does not know the job.
    """
    jobs = client(address)
    return str(_known_job(job_id, lambda: jobs.get_job_status(job_id)).value)


def stop(address: str, job_id: str) -> bool:
    """Asks the cluster to stop the job; returns True if it was still running.

    Raises ClusterError when the cluster is unreachable or does not know the job.
    """
    jobs = client(address)
    return _known_job(job_id, lambda: jobs.stop_job(job_id))


def _known_job(job_id: str, call):
    try:
        return call()
    except RuntimeError as error:  # the Jobs API answers an unknown id with a 404 RuntimeError
        raise ClusterError(f"job {job_id}: {str(error).strip().splitlines()[0][:200]}") from None
