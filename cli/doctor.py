"""``specedge doctor``: what this machine can run, and what to install for the rest.

Every probe is read-only and fails soft: a missing tool or package shows up as
"no", never as a traceback. ``--json`` prints the same facts as one object.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

import click

from ..engines.hugepages import HUGEPAGE_TUNABLE, describe, hugepages

# CPU features that decide which ORT kernels run: AVX2 is the baseline, AVX-512 widens the
# fp32 GEMMs, and VNNI (AVX512-VNNI or AVX-VNNI) is what makes int8 activations (MatMulNBits
# accuracy level 4) fast.
_CPU_FLAGS = {"avx2": ("avx2",), "avx512": ("avx512f",), "vnni": ("avx512_vnni", "avx_vnni")}


def _module_version(module: str) -> dict[str, Any]:
    try:
        mod = __import__(module, fromlist=["__version__"])
    except Exception as exc:  # ImportError, or OSError when a wheel's native libraries are missing
        error = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return {"importable": False, "version": None, "error": error}
    return {"importable": True, "version": getattr(mod, "__version__", None), "error": None}


def _cuda_python() -> dict[str, Any]:
    for module in ("cuda.bindings.runtime", "cuda.cudart"):  # new and old layouts
        info = _module_version(module)
        if info["importable"]:
            try:
                info["version"] = info["version"] or importlib.metadata.version("cuda-python")
            except importlib.metadata.PackageNotFoundError:
                pass
            return info
    return info


def _onnxruntime() -> dict[str, Any]:
    """The ORT install and, per provider, whether a session actually loads and runs on it (and why not).

    ``usable`` means loadable: onnxruntime-gpu lists TensorRT among its providers whether or
    not TensorRT is installed (onnxruntime#13501), so each provider is probed on a tiny graph.
    """
    from ..engines.base import PROVIDERS
    from ..engines.providers import installed_onnxruntime_distributions, onnxruntime_install_problem, probe_provider

    installed = installed_onnxruntime_distributions()
    info = _module_version("onnxruntime")
    common = {"package": installed[0] if len(installed) == 1 else None, "installed": installed,
              "install_problem": onnxruntime_install_problem(installed)}
    if not info["importable"]:
        return {**info, **common, "execution_providers": [], "providers": {},
                "usable": dict.fromkeys(PROVIDERS, False)}
    import onnxruntime as ort

    probes = {name: probe_provider(name) for name in PROVIDERS}
    return {**info, **common, "execution_providers": list(ort.get_available_providers()),
            "providers": {name: p.to_json() for name, p in probes.items()},
            "usable": {name: p.loadable for name, p in probes.items()}}


def _installed(distribution: str) -> bool:
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def _extras() -> dict[str, bool]:
    """Each specedge extra, and whether every distribution it names is installed."""
    try:
        requirements = importlib.metadata.requires("specedge") or []
    except importlib.metadata.PackageNotFoundError:
        return {}
    wanted: dict[str, list[str]] = {}
    for req in requirements:
        extra = re.search(r"""extra\s*==\s*["']([^"']+)["']""", req)
        name = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", req)
        if extra and name:
            wanted.setdefault(extra.group(1), []).append(name.group(0))
    return {extra: all(_installed(n) for n in names) for extra, names in sorted(wanted.items())}


def _cpu(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, Any]:
    model, flags, cores = platform.processor() or None, set(), set()
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    physical = core = None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and value:
            model = value
        elif key == "flags":
            flags |= set(value.split())
        elif key == "physical id":
            physical = value
        elif key == "core id":
            core = value
            cores.add((physical, core))
    return {"model": model, "logical_cores": os.cpu_count(), "physical_cores": len(cores) or None,
            "flags": {name: any(f in flags for f in names) for name, names in _CPU_FLAGS.items()} if flags else {}}


def _memory(meminfo: Path = Path("/proc/meminfo")) -> dict[str, Any]:
    values = {}
    try:
        for line in meminfo.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                values[key] = int(rest.split()[0]) * 1024  # /proc/meminfo counts kB
    except (OSError, ValueError, IndexError):
        pass
    return {"total_bytes": values.get("MemTotal"), "available_bytes": values.get("MemAvailable")}


def collect() -> dict[str, Any]:
    """Every fact ``specedge doctor`` reports, as plain data."""
    from .. import __version__
    from ..engines.tensorrt import nvidia_smi_gpus

    return {
        "specedge": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "onnxruntime": _onnxruntime(),
        "tensorrt": _module_version("tensorrt"),
        "cuda_python": _cuda_python(),
        "gpus": nvidia_smi_gpus(),
        "cpu": _cpu(),
        "memory": _memory(),
        "hugepages": hugepages(),
        "extras": _extras(),
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _hints(facts: dict[str, Any]) -> list[str]:
    ort, hints = facts["onnxruntime"], []
    if ort.get("install_problem"):
        hints.append(ort["install_problem"])
    compiled = {name: p["compiled"] for name, p in ort.get("providers", {}).items()}
    if facts["gpus"] and not ort["usable"]["cuda"]:
        if compiled.get("cuda"):
            reason = ort["providers"]["cuda"]["reason"]
            hints.append(f"onnxruntime-gpu is installed but its CUDA provider does not load ({reason}): check the "
                         "driver and CUDA/cuDNN versions against docs/GPU.md")
        else:
            hints.append("a GPU is present but ONNX Runtime has no CUDA provider: pip uninstall -y onnxruntime && "
                         "pip install 'specedge[gpu]' (onnxruntime-gpu; install exactly one of the two)")
    if ort["usable"]["cuda"] and not ort["usable"]["tensorrt"]:
        hints.append("TensorRT EP does not load: install TensorRT 10 from NVIDIA's index (docs/GPU.md, 'TensorRT')")
    pages = facts.get("hugepages") or {}
    if pages.get("thp_mode") == "madvise" and pages.get("glibc_can") and not pages.get("malloc_tunable"):
        hints.append(f"CPU decoding: start specedge with GLIBC_TUNABLES={HUGEPAGE_TUNABLE} so the packed weights sit "
                     "in 2 MB pages (Qwen2.5-Coder-1.5B int4: a step ~4% faster, 10% more resident memory; "
                     "docs/PYTHON.md, 'Huge pages')")
    return hints


def render(facts: dict[str, Any]) -> str:
    ort = facts["onnxruntime"]
    lines = [f"specedge {facts['specedge']} (python {facts['python']}, {facts['platform']})"]
    if ort["importable"]:
        lines.append(f"onnxruntime {ort['version']} ({ort['package'] or 'unknown package'})")
    else:
        lines.append(f"onnxruntime: not importable ({ort['error']})")
    lines.append("  providers: " + ", ".join(f"{name} {_yes(ok)}" for name, ok in ort["usable"].items()))
    for name, probe in ort.get("providers", {}).items():
        if probe["compiled"] and not probe["loadable"]:
            lines.append(f"  {name}: compiled in, does not load: {probe['reason']}")
    for label, key in (("tensorrt", "tensorrt"), ("cuda-python", "cuda_python")):
        info = facts[key]
        lines.append(f"{label}: {info['version'] or 'installed'}" if info["importable"]
                     else f"{label}: not importable ({info['error']})")
    if facts["gpus"]:
        for gpu in facts["gpus"]:
            memory = f", {gpu['memory_mib'] / 1024:.0f} GiB" if gpu["memory_mib"] else ""
            lines.append(f"GPU {gpu['index']}: {gpu['name']}, compute capability {gpu['compute_capability'] or '?'}"
                         f"{memory}, driver {gpu['driver']}")
    else:
        lines.append("GPU: none detected (no nvidia-smi, or it lists no GPU)")
    cpu = facts["cpu"]
    flags = ", ".join(f"{name.upper()} {_yes(ok)}" for name, ok in cpu["flags"].items()) or "flags unknown"
    lines.append(f"CPU: {cpu['model'] or 'unknown'}, {cpu['logical_cores']} logical / "
                 f"{cpu['physical_cores'] or '?'} physical cores, {flags}")
    mem = facts["memory"]
    if mem["total_bytes"]:
        lines.append(f"RAM: {mem['total_bytes'] / 2**30:.1f} GiB total, "
                     f"{(mem['available_bytes'] or 0) / 2**30:.1f} GiB available")
    if (facts.get("hugepages") or {}).get("thp_mode"):
        lines.append(f"huge pages: {describe(facts['hugepages'])}")
    lines.append("extras: " + (", ".join(f"{name} {_yes(ok)}" for name, ok in facts["extras"].items()) or "unknown"))
    lines += [f"hint: {h}" for h in _hints(facts)]
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the facts as one JSON object.")
@click.option("--verify", is_flag=True,
              help="Export tiny random models and check every GPU route that loads here (tokens against the CPU "
                   "engine, 256-byte alignment of every bound address, step and verify time against the "
                   "bandwidth floor); prints one JSON report, exit status 1 when a check fails. Needs the "
                   "export extra (torch).")
@click.option("--device-id", type=click.IntRange(min=0), default=0, show_default=True, help="CUDA device for --verify.")
def doctor(as_json: bool, verify: bool, device_id: int) -> None:
    """Report what this machine can run: ONNX Runtime providers, TensorRT, GPUs, CPU features, RAM, extras."""
    if verify:
        from ..bench.device_check import run_verify

        report = run_verify(device_id, machine=collect())
        click.echo(json.dumps(report, indent=2))
        if not report["ok"]:
            raise SystemExit(1)
        return
    facts = collect()
    click.echo(json.dumps(facts, indent=2) if as_json else render(facts))
