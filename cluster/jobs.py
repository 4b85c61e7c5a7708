"""Submitting a training job to a running Ray cluster through Ray's Jobs API.

The project's packages and configs travel as the job's working dir, with the
resolved config written beside them, so the cluster runs exactly what was
submitted. Token authentication stays on: the token comes from
RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or Ray's token file, and is never
printed or written anywhere by nestor.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from nestor.cluster.connect import stage_project, use_token_if_present
from nestor.cluster.rendezvous import ClusterError

SUBMITTED_CONFIG = ".nestor/config.yaml"
AGENT_WAIT_S = 60.0  # how long a submission waits for a just-started head's job agent
# How long `stop` lets the job's driver end after its SIGTERM (the workers save the step they reach) before
# Ray kills it: Ray's own default is 3 s. RAY_JOB_STOP_WAIT_TIME_S in the submitting shell overrides it.
STOP_WAIT_S = 600
# The job's Python: the first of python3, python on the head's PATH (POSIX sh).
ENTRYPOINT_PYTHON = '"$(command -v python3 || command -v python)"'
# Ray's own INFO records in a job's log ("Runtime env is setting up."), which `follow` leaves out.
RAY_INFO_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\s+INFO \S+\.py:\d+ -- ")


def client(address: str):
    """Returns a JobSubmissionClient for `address`.

    Raises ClusterError with one line when nothing answers there.
    """
    use_token_if_present()
    from ray.job_submission import JobSubmissionClient

    # The SDK's INFO lines (packaging the upload, closing the log stream) are not the job's output.
    for name in ["ray", *[name for name in logging.root.manager.loggerDict if name.startswith("ray.")]]:
        logging.getLogger(name).setLevel(logging.WARNING)

    try:
        return JobSubmissionClient(address)
    except Exception as error:  # Ray raises ConnectionError, RuntimeError or ValueError here
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ClusterError(f"--address {address}: no Ray cluster answers there ({reason[:200]}); "
                           "start one with `ray start --head` or pass its dashboard URL, e.g. "
                           "http://127.0.0.1:8265") from None


def _one_line(error: BaseException, limit: int = 300) -> str:
    """Returns the gist of a Jobs API error: its last non-empty line (HTTP errors end with the server's reason)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return (lines[-1] if lines else type(error).__name__)[:limit]


def _jobs_call(address: str, what: str, call):
    """Runs a Jobs API call; raises ClusterError with one line when the cluster refuses or fails it."""
    try:
        return call()
    except ClusterError:
        raise
    except Exception as error:  # the SDK raises RuntimeError for HTTP errors, ConnectionError and others
        raise ClusterError(f"--address {address}: {what} failed: {_one_line(error)}") from None


def submit(address: str, config_yaml: str, command: str = "train", user_code: tuple[str, ...] = ()) -> str:
    """Submits `nestor <command>` on `config_yaml` (resolved config text); returns the submission id.

    The job runs `python -m nestor.orchestrator` from the project directory (uploaded as
    its working dir, with the user's own modules and packages `user_code` beside
    nestor's) with the Python on the cluster's PATH; a Python without
    nestor's dependencies ends the job with one line naming them. Raises
    ClusterError (one line) when the cluster cannot be reached or refuses the job.
    """
    jobs = client(address)
    with tempfile.TemporaryDirectory(prefix="nestor-submit-") as staging:
        working_dir = stage_project(Path(staging) / "project", user_code)
        (working_dir / SUBMITTED_CONFIG).parent.mkdir(exist_ok=True)
        (working_dir / SUBMITTED_CONFIG).write_text(config_yaml)
        submit_job = functools.partial(
            jobs.submit_job, entrypoint=f"{ENTRYPOINT_PYTHON} -m nestor.orchestrator {command} {SUBMITTED_CONFIG}",
            runtime_env={"working_dir": str(working_dir), "env_vars": {"RAY_JOB_STOP_WAIT_TIME_S": os.environ.get(
                "RAY_JOB_STOP_WAIT_TIME_S", str(STOP_WAIT_S))}})
        return _jobs_call(address, "submitting the job", lambda: _when_agent_ready(submit_job))


def _when_agent_ready(call):
    """Returns call(), retried for up to AGENT_WAIT_S while the cluster answers that it has no job agent yet
    (a head that has just started serves the Jobs API a few seconds before its agent)."""
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            return call()
        except RuntimeError as error:
            if "No available agent" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def follow(address: str, job_id: str, out=sys.stdout) -> str:
    """Streams the job's logs to `out` until it ends; returns its final status (SUCCEEDED, FAILED, STOPPED).

    Raises ClusterError (one line) when the cluster stops answering.
    """
    jobs = client(address)

    async def stream():
        async for lines in jobs.tail_job_logs(job_id):
            out.write("".join(line for line in lines.splitlines(keepends=True) if not RAY_INFO_LINE.match(line)))
            out.flush()

    _jobs_call(address, f"streaming the logs of {job_id}", lambda: asyncio.run(stream()))
    return str(_jobs_call(address, f"asking the status of {job_id}", lambda: jobs.get_job_status(job_id)).value)


def logs(address: str, job_id: str) -> str:
    """Returns the job's output so far (all of it once the job has ended), without Ray's own info lines.

    Raises ClusterError when the cluster is unreachable or does not know the job.
    """
    jobs = client(address)
    text = _jobs_call(address, f"reading the logs of job {job_id}", lambda: jobs.get_job_logs(job_id))
    return "".join(line for line in text.splitlines(keepends=True) if not RAY_INFO_LINE.match(line))


def status(address: str, job_id: str) -> str:
    """Returns the job's status name (PENDING, RUNNING, SUCCEEDED, FAILED, STOPPED).

    Raises ClusterError when the cluster is unreachable or does not know the job.
    """
    jobs = client(address)
    return str(_jobs_call(address, f"asking the status of job {job_id}", lambda: jobs.get_job_status(job_id)).value)


def stop(address: str, job_id: str) -> bool:
    """Asks the cluster to stop the job; returns True if it was still running. Ray sends the job's driver a
    SIGTERM, which the workers of `nestor train` answer by saving the step they reach; the driver is
    killed if it has not ended within the job's RAY_JOB_STOP_WAIT_TIME_S (`submit`: STOP_WAIT_S).

    Raises ClusterError when the cluster is unreachable or does not know the job.
    """
    jobs = client(address)
    return _jobs_call(address, f"stopping job {job_id}", lambda: jobs.stop_job(job_id))
