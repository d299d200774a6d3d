"""What machine a number was measured on: hardware, versions, load, the code's git commit, the peak
memory of a process (read by the run records and the throughput records); ``allocator`` holds the
C library's memory settings the trainer and the benchmark choose."""
from __future__ import annotations

import os
import platform
import resource
import socket
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from . import allocator


def git_commit() -> str:
    """The commit of the checkout the package runs from, with ``+dirty`` for local changes to its
    tracked files outside results/ (a record made again over its committed files is not a change
    of the code that made it)."""
    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ":(top,exclude)results"],
            cwd=here, capture_output=True, text=True, timeout=5,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: torch.device) -> Dict[str, Any]:
    # the CPU's model: ratios between backends differ from one CPU to another (AVX2, AVX-512)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    return {
        "device": str(device),
        "device_name": f"{name} ({os.cpu_count()} CPUs visible)" if device.type == "cpu" else name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "hostname": socket.gethostname(),
        "boot_id": boot_id(),
        "allocator": allocator.describe(),
    }


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's processor string elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def boot_id() -> Optional[str]:
    """This boot of this machine (Linux's random boot id): runs that share it ran on one machine, even
    where hostnames repeat across machines ("vm"); None where the kernel has none."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def meminfo_gb(field: str) -> Optional[float]:
    """A field of /proc/meminfo (MemTotal, MemAvailable) in GiB; None where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def load_average() -> List[float]:
    """The 1, 5 and 15 minute load averages: how busy the machine was besides the benchmark."""
    return [round(x, 2) for x in os.getloadavg()]


def matmul_rate(device: torch.device, size: int = 1024, repeats: int = 5) -> float:
    """GFLOP/s of a float32 ``size`` x ``size`` matmul at this process's torch thread count (median of
    ``repeats``; 0.1-0.5 s on a 2-core CPU): a stamp of how fast the machine was. Two machines with
    the same name and load can differ 2x (the ListOps cpu runs met one such pair), and train times
    compare only between runs whose stamps agree."""
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seconds = []
    for _ in range(repeats + 1):  # the first product warms the thread pool up and is not counted
        sync()
        start = time.perf_counter()
        a @ b
        sync()
        seconds.append(time.perf_counter() - start)
    return round(2 * size**3 / statistics.median(seconds[1:]) / 1e9, 1)


def hardware(device: torch.device) -> Dict[str, Any]:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: Dict[str, Any] = {
        "device": device.type,
        "cpu_model": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": usable,
        # torch's default thread count; a sweep's --threads, when given, is what its points use
        "torch_threads": torch.get_num_threads(),
        "memory_gb": meminfo_gb("MemTotal"),
        "memory_available_gb": meminfo_gb("MemAvailable"),
        "hostname": socket.gethostname(),
        "gpu": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info["gpu"] = props.name
        info["gpu_memory_gb"] = props.total_memory / 2**30
    return info


def versions() -> Dict[str, Any]:
    try:
        import flash_attn

        flash = flash_attn.__version__
    except ImportError:
        flash = None
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "flash_attn": flash,
        "git_commit": git_commit(),
        "allocator": allocator.describe(benchmark=True),
    }


def describe(hw: Dict[str, Any]) -> str:
    """One line naming the hardware, e.g. 'AMD EPYC, 2 cores' or 'NVIDIA H100 80GB HBM3'."""
    if hw.get("gpu"):
        return str(hw["gpu"])
    return f"{hw['cpu_model']}, {hw['cpu_cores_usable']} cores"


def peak_memory_mb(device: torch.device) -> Tuple[float, str]:
    """The peak memory of this process on ``device`` so far, MB, and what was measured."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    # ru_maxrss is in KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "cpu_peak_rss"
