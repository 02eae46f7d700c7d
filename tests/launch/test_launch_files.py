"""The launch files of launch/ (SLURM, Kubernetes JobSet) against the start-up rules of
lumen_jax.runtime.distributed."""

import os
import subprocess

import yaml

from helpers.paths import REPO
from lumen_jax.config import DistributedConfig
from lumen_jax.runtime import distributed as D


def test_launch_files_agree_with_the_start_up_rules():
    """The SLURM script parses and the JobSet's process count matches its pod count."""
    assert subprocess.run(["bash", "-n", "launch/slurm.sbatch"], cwd=REPO, timeout=30).returncode == 0
    jobset = yaml.safe_load(open(os.path.join(REPO, "launch", "k8s-jobset.yaml")))
    job = jobset["spec"]["replicatedJobs"][0]
    pod = job["template"]["spec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}
    assert int(env["JAX_NUM_PROCESSES"]) == job["template"]["spec"]["completions"] * job["replicas"]
    name, sub = jobset["metadata"]["name"], jobset["spec"]["network"]["subdomain"]
    assert env["JAX_COORDINATOR_ADDRESS"].startswith(f"{name}-{job['name']}-0-0.{sub}:")
    args = D.resolve(DistributedConfig(), env={**env, "JOB_COMPLETION_INDEX": "1"})
    assert args["process_id"] == 1 and args["num_processes"] == 2
