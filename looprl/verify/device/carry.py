"""The carry: what travels to a device whose image has its own jax, and the one line run there.

`build(dir)` writes looprl's own wheel (`pip wheel --no-deps`, from this source checkout) and
the wheels of every runtime dependency the device image lacks, with the dependencies those
need, for the device's Python on manylinux x86_64 (`pip download --only-binary=:all:`).
What the image has (`DEVICE_IMAGE`, the GPU machines' package list) stays out: the device's
jax, flax and numpy are used as they are. Versions: `constraints.txt`'s pins where it names
the package. Installed there with `pip install --no-deps --target`, looprl runs on the
image's jax (0.11.x: `looprl.compat`).
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement

from looprl.errors import ConfigError, create_dir

ROOT = Path(__file__).resolve().parents[3]
LIMIT_BYTES = 64 * 2 ** 20
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")
# the Python packages of the GPU machines' image ('cuda'), normalized names
DEVICE_IMAGE = frozenset("""absl-py accelerate attrs certifi charset-normalizer chex click
cloudpickle contourpy cycler einops etils filelock flax fonttools fsspec h5py huggingface-hub
humanize idna jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jinja2 joblib kiwisolver markdown
markdown-it-py markupsafe matplotlib mdurl ml-dtypes mpmath msgpack networkx numpy opt-einsum
optax orbax-checkpoint packaging pandas pillow pip pluggy protobuf psutil pygments pyparsing
python-dateutil pyyaml regex requests rich safetensors scipy setuptools six sympy tensorboard
tensorstore tokenizers toolz tqdm treescope typing-extensions urllib3 wheel wrapt zipp
simplejson tabulate pytest""".split())


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_requirements(root: Path = ROOT) -> list[str]:
    """looprl's runtime requirements as `pyproject.toml` lists them. Raises ConfigError outside
    a source checkout (no pyproject.toml beside the package)."""
    path = root / "pyproject.toml"
    if not path.is_file():
        raise ConfigError(f"--carry builds looprl's wheel from a source checkout; {path} is "
                          "missing")
    import tomllib  # Python 3.11's; the carry is built where the checkout is
    return list(tomllib.loads(path.read_text())["project"]["dependencies"])


def _pins(root: Path) -> dict[str, str]:
    """constraints.txt's pins by normalized name (`name==version`)."""
    pins = {}
    cons = root / "constraints.txt"
    if cons.is_file():
        for line in cons.read_text().splitlines():
            if "==" in line and not line.startswith("#"):
                pins[normalize(line.split("==")[0])] = line.strip()
    return pins


def _target_env(python_version: str) -> dict[str, str]:
    """The marker environment of the device's Python on Linux x86_64."""
    return {"python_version": python_version, "python_full_version": python_version + ".0",
            "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "os_name": "posix", "extra": ""}


def _fetch(spec: str, out: Path, python_version: str) -> Path | None:
    """The wheel of `spec` in `out`: a binary wheel for the device's Python and platform, else
    (a package published as source only) a wheel built here, kept when pure Python or built
    by the device's Python. Returns its path, or None when it cannot travel."""
    before = set(out.glob("*.whl"))
    pip = [sys.executable, "-m", "pip"]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    got = subprocess.run(pip + ["download", "-q", "--no-deps", "--only-binary=:all:",
                                "--python-version", python_version, "--implementation", "cp",
                                *plat, "-d", str(out), spec], capture_output=True, text=True)
    built = got.returncode != 0
    if built:
        _run(pip + ["wheel", "-q", "--no-deps", "-w", str(out), spec], spec)
    new = sorted(set(out.glob("*.whl")) - before)
    here = "%d.%d" % sys.version_info[:2]
    if built and new and not new[0].name.endswith("-none-any.whl") and python_version != here:
        new[0].unlink()  # compiled for this Python, not the device's
        return None
    if not new:  # already there
        name = normalize(re.split(r"[<>=!~ \[;]", spec, maxsplit=1)[0])
        new = [w for w in out.glob("*.whl") if _wheel_name(w) == name]
    return new[0]


def _wheel_name(path: Path) -> str:
    return normalize(path.name.split("-")[0])


def build(out: Path, python_version: str = "3.12", root: Path = ROOT,
          left_out: list | None = None) -> list[Path]:
    """Write the carry into `out` (created; old wheels removed): looprl's wheel and the missing
    dependencies' wheels for `python_version` on manylinux x86_64. Returns the wheels;
    `left_out` gets the packages published as compiled source only, which this machine cannot
    build for another Python (the device check imports none of them: a task may). Raises
    ConfigError when pip fails (its last lines) or the carry passes 64 MiB."""
    left_out = [] if left_out is None else left_out
    out = create_dir(out, "--carry")
    for old in out.glob("*.whl"):
        old.unlink()
    pip = [sys.executable, "-m", "pip"]
    with tempfile.TemporaryDirectory() as tmp:  # no build/ left in, or read from, the checkout
        src = Path(tmp) / "src"
        shutil.copytree(root / "looprl", src / "looprl",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy2(root / name, src / name)
        _run(pip + ["wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], "looprl's wheel")
    pins = _pins(root)
    queue = list(runtime_requirements(root))
    done: set[str] = set()
    left_out.clear()
    while queue:  # the missing requirements, then theirs, for the device's Python
        req = Requirement(queue.pop(0))
        name = normalize(req.name)
        if (name in DEVICE_IMAGE or name in done
                or (req.marker and not req.marker.evaluate(_target_env(python_version)))):
            continue
        done.add(name)
        spec = pins.get(name, f"{name}{req.specifier}")
        wheel = _fetch(spec, out, python_version)
        if wheel is None:
            left_out.append(spec)
        else:
            queue += requires(wheel)
    wheels = sorted(out.glob("*.whl"))
    for w in wheels:
        if _wheel_name(w) in DEVICE_IMAGE:
            w.unlink()  # the image's own version stays in force
    wheels = sorted(out.glob("*.whl"))
    names = [_wheel_name(w) for w in wheels]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"--carry: two versions of {dup} in {out}")
    size = sum(w.stat().st_size for w in wheels)
    if size > LIMIT_BYTES:
        raise ConfigError(f"--carry: {size / 2 ** 20:.1f} MiB in {out}, over the 64 MiB a "
                          "device call carries")
    return wheels


def _run(cmd: list[str], what: str) -> None:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise ConfigError(f"--carry: pip failed building {what}: "
                          f"{(p.stdout + p.stderr).strip()[-800:]}")


def device_line(carry: Path, site: str = "/tmp/looprl-site",
                check: str = "/tmp/looprl-check") -> str:
    """The one shell line run on the device from the folder that holds `carry`: install the
    wheels with --no-deps into `site`, run the check, copy its report into $OUT."""
    c = shlex.quote(str(carry))
    return (f"python3 -m pip install -q --no-index --no-deps --no-compile --target {site} "
            f"{c}/*.whl && PYTHONPATH={site} PYTHONUNBUFFERED=1 python3 -m looprl.cli verify "
            f"--device {check}; s=$?; cp {check}/report.json {check}/report.md \"$OUT\"/; "
            "exit $s")


def requires(wheel: Path) -> list[str]:
    """A wheel's `Requires-Dist` lines (its METADATA)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [ln.split(":", 1)[1].strip() for ln in text.splitlines()
            if ln.startswith("Requires-Dist:")]


def build_and_print(out: Path, python_version: str = "3.12") -> int:
    """`looprl verify --device --carry DIR`: build the carry, print its size on stderr and the
    device line on stdout."""
    left_out: list[str] = []
    wheels = build(out, python_version, left_out=left_out)
    size = sum(w.stat().st_size for w in wheels)
    print(f"looprl verify --carry: {len(wheels)} wheels, {size / 2 ** 20:.1f} MiB in {out} "
          f"(Python {python_version}, manylinux x86_64): "
          + ", ".join(w.name for w in wheels), file=sys.stderr)
    if left_out:
        print(f"looprl verify --carry: left out {', '.join(left_out)}: source only, compiled, "
              f"not buildable here for Python {python_version} (the device check does not "
              "import it)", file=sys.stderr)
    print(device_line(out))
    return 0
