"""scripts/device_check's body (that bash entry picks the Python); see its header and docs/gpu.md."""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))  # device_wheels.py beside it, also when loaded by path
from device_wheels import MANIFEST, OVERLAY, TARGET_PYTHON, WHEELS, prepare, say  # noqa: E402

GPU_TESTS_TIMEOUT_S = 270
BENCH_TIMEOUT_S = 260  # an H100 took ~200 s for the 9 rows (2026-11-26)
# --cpu-scaling: 8 layouts of ~45 s each (start, ramp, 15 s window, stop) fit in the deadline; the kill after it
# leaves the rows printed so far (docs/gpu.md has the arithmetic).
SCALING_DEADLINE_S = 420
SCALING_TIMEOUT_S = 500


# -- the check -------------------------------------------------------------------------------------------


def pinned_transformers() -> str | None:
    match = re.search(r'"transformers==([^"]+)"', (ROOT / "pyproject.toml").read_text())
    return match.group(1) if match else None


def environment(python: str) -> tuple[list[str], bool]:
    lines = [f"python {platform.python_version()} ({sys.executable}), {platform.machine()}"]
    cuda = False
    try:
        import torch

        cuda = torch.cuda.is_available()
        lines.append(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}; CUDA available: {cuda}")
        if cuda:
            props = torch.cuda.get_device_properties(0)
            lines.append(f"GPU: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, "
                         f"{props.total_memory / 2**30:.1f} GiB, compute capability {props.major}.{props.minor}")
    except Exception as exc:  # noqa: BLE001 - reported, the check goes on
        lines.append(f"torch: not importable ({exc})")
    smi = shutil.which("nvidia-smi")
    if smi:
        done = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True)
        lines.append(f"nvidia-smi: {done.stdout.strip() or done.stderr.strip()}")
    else:
        lines.append("nvidia-smi: not found")
    for name in ("transformers", "accelerate"):
        try:
            module = __import__(name)
            lines.append(f"{name} {module.__version__}")
        except Exception as exc:  # noqa: BLE001
            lines.append(f"{name}: not importable ({exc})")
    pin = pinned_transformers()
    try:
        import transformers

        if pin and transformers.__version__ != pin:
            lines.append(f"WARNING: transformers {transformers.__version__} differs from the pin {pin} "
                         "(pyproject.toml): a failure may come from the version, not the GPU")
    except Exception:  # noqa: BLE001
        pass
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    model = re.search(r"Model name:\s*(.+)", cpu)
    lines.append(f"CPU: {model.group(1).strip() if model else '?'}, {os.cpu_count()} cores")
    if MANIFEST.is_file():
        prepared = json.loads(MANIFEST.read_text())["python"]
        here = ".".join(platform.python_version_tuple()[:2])
        if prepared != here:
            lines.append(f"WARNING: .device_wheels was prepared for Python {prepared} and this is {here}: compiled "
                         f"wheels (pydantic-core, llguidance, psutil) will not install; run "
                         f"`scripts/device_check --prepare --python {here}` where pip works")
    return lines, cuda


def install(env: dict) -> list[str]:
    """The carried wheels that this python lacks (or has at another version) into OVERLAY."""
    from importlib import metadata

    if not MANIFEST.is_file():
        return ["no .device_wheels/manifest.json: using this python's packages as they are"]
    manifest = json.loads(MANIFEST.read_text())
    needed = []
    for name, entry in manifest["packages"].items():
        try:
            if metadata.version(name) == entry["version"]:
                continue
        except metadata.PackageNotFoundError:
            pass
        if entry.get("wheel"):
            needed.append(WHEELS / entry["wheel"])
    notes = [f"wheels: {len(manifest['packages']) - len(needed)} of {len(manifest['packages'])} already here"]
    if not needed:
        return notes
    base = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-index",
            "--no-deps", "--no-compile", "--upgrade", "--target", str(OVERLAY)]
    done = subprocess.run(base + [str(w) for w in needed], capture_output=True, text=True)
    if done.returncode != 0:
        failed = []
        for wheel in needed:  # one by one: install what installs, name what does not
            if subprocess.run(base + [str(wheel)], capture_output=True, text=True).returncode != 0:
                failed.append(wheel.name)
        notes.append(f"WARNING: these wheels did not install: {', '.join(failed)}")
    notes.append(f"installed {len(needed)} wheels into {OVERLAY}: {', '.join(w.name.split('-')[0] for w in needed)}")
    return notes


def run_logged(command: list[str], log: Path, env: dict, timeout: float) -> tuple[int | None, float]:
    """Run `command`, its output to `log` and to stdout; (exit code, seconds), or (None, seconds) when it was
    killed at `timeout`. The deadline is a timer, not a check between lines: a child that prints nothing (a
    hung test) is killed on time too, with its process group (a test's own subprocesses hold the pipe open)."""
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(timeout, expire)
        timer.start()
        try:
            for line in proc.stdout:
                out.write(line)
                sys.stdout.write(line)
                sys.stdout.flush()
            code = proc.wait()
        finally:
            timer.cancel()
        if expired.is_set():
            out.write(f"\n[device_check] killed after {timeout} s\n")
            return None, time.monotonic() - started
        return code, time.monotonic() - started


def test_rows(junit: Path) -> list[list[str]]:
    if not junit.is_file():
        return [["test", "(no junit XML: pytest did not finish)", "error", "", "", "", "", ""]]
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome, note = "passed", f"{float(case.get('time', 0)):.1f} s"
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[kind]
                message = (found.get("message") or found.text or "").strip().splitlines()
                note = (message[0] if message else "")[:160]
                break
        rows.append(["test", name, outcome, "", "", "", "", note.replace("|", "/")])
    return rows


def bench_result(result: Path, log: Path) -> dict | None:
    """bench.json, else the JSON lines the benchmark printed (a run killed at its limit still printed its rows)."""
    if result.is_file() and result.stat().st_size:
        return json.loads(result.read_text())
    lines = []
    for line in (log.read_text().splitlines() if log.is_file() else []):
        try:
            lines.append(json.loads(line))
        except ValueError:
            continue
    lines = [item for item in lines if isinstance(item, dict)]
    if not lines or "model" not in lines[0]:
        return None
    return {"header": lines[0], "rows": [row for row in lines[1:] if "system" in row]}


def bench_rows(data: dict | None) -> tuple[list[list[str]], list[str]]:
    if data is None:
        return [["bench", "(no result: see bench.log)", "error", "", "", "", "", ""]], []
    header = data["header"]
    rows = []
    for row in data["rows"]:
        def cell(key):
            value = row.get(key)
            return "" if value is None else str(value)
        rows.append(["bench", f"{row['system']} @ {row['clients']} clients", "ok" if "tok_s" in row else "-",
                     cell("tok_s") + (f" ({row['x_rolling']}x)" if row.get("x_rolling") not in (None, 1.0) else ""),
                     cell("ttft_p50_ms"), cell("itl_p50_ms"), cell("peak_gpu_mib"), cell("note").replace("|", "/")])
    ceiling = header.get("ceiling_tok_s_batch1")
    rows.append(["bench", "weight-bandwidth ceiling, batch 1", "-",
                 str(ceiling) if ceiling else "unknown", "", "", "",
                 f"{header['weights_bytes'] / 1e9:.2f} GB of weights / "
                 f"{header['bandwidth_tb_s'] or '?'} TB/s ({header['gpu']})"])
    notes = [f"benchmark: {header['model']}, {header['prompt_tokens']} prompt + {header['new_tokens']} new tokens per "
             f"request, {header['gpu']}, torch {header['torch']}, transformers {header['transformers']}"]
    return rows, notes


def prepared(python: str, imports: str) -> tuple[Path, dict, list[str], bool, bool]:
    """Both parts' start: $OUT (else a temporary folder), the environment printed, the carried wheels installed
    into OVERLAY, and `imports` tried once (a missing module named before anything runs). Returns (out, the
    children's environment, the report's environment lines, whether CUDA is there, whether `imports` imported)."""
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(tempfile.mkdtemp(prefix="device_check-"))
    out.mkdir(parents=True, exist_ok=True)
    env_lines, cuda = environment(python)
    say("## Environment")
    for line in env_lines:
        say(f"- {line}")
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error",
               PYTHONPATH=os.pathsep.join([str(OVERLAY), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    for line in install(env):
        env_lines.append(line)
        say(f"- {line}")
    smoke = subprocess.run([sys.executable, "-c", f"import {imports}, transformers, accelerate; "
                            "print(transformers.__version__, accelerate.__version__)"],
                           cwd=ROOT, env=env, capture_output=True, text=True)
    if smoke.returncode == 0:
        seen = smoke.stdout.split()
        env_lines.append(f"imports transformers {seen[0]} and accelerate {seen[1]} (the overlay's, else the image's)")
    else:
        env_lines.append(f"WARNING: importing {imports} failed: {smoke.stderr.strip().splitlines()[-1]}")
    say(f"- {env_lines[-1]}")
    return out, env, env_lines, cuda, smoke.returncode == 0


def check(args) -> int:
    started = time.monotonic()
    out, env, env_lines, cuda, _ = prepared(args.python, "lmi_serve.engine.engine, lmi_serve.model.loader, pytest")

    say("\n## GPU tests (pytest -m gpu tests/gpu)")
    junit = out / "junit.xml"
    junit.unlink(missing_ok=True)
    rc, took = run_logged([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-rA", "-q", "-p",
                           "no:cacheprovider", f"--junitxml={junit}"], out / "pytest.log", env, args.tests_timeout)
    env_lines.append(f"gpu tests: exit {rc if rc is not None else 'killed (timeout)'} in {took:.0f} s")

    say("\n## Benchmark (benchmarks/bench_gpu.py)")
    result = out / "bench.json"
    result.unlink(missing_ok=True)
    bench = [sys.executable, "-m", "benchmarks.bench_gpu", "--json", str(result), *args.bench_args.split()]
    if not cuda:
        bench.append("--cpu-tiny")
    rc, took = run_logged(bench, out / "bench.log", env, args.bench_timeout)
    env_lines.append(f"benchmark: exit {rc if rc is not None else 'killed (timeout)'} in {took:.0f} s")

    rows = test_rows(junit)
    more, notes = bench_rows(bench_result(result, out / "bench.log"))
    rows += more
    head = ["part", "item", "result", "tok/s (x rolling)", "TTFT p50 ms", "ITL p50 ms", "peak GPU MiB", "note"]
    table = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    table += ["| " + " | ".join(row) + " |" for row in rows]
    title = "GPU check" if cuda else "DRY RUN (no CUDA): GPU tests skipped, benchmark = tiny CPU variant"
    report = [f"# {title}, {time.strftime('%Y-%m-%d %H:%M')}, {time.monotonic() - started:.0f} s", ""]
    report += [f"- {line}" for line in env_lines + notes] + [""] + table
    (out / "device_check.md").write_text("\n".join(report) + "\n")
    say("\n" + "\n".join(report))
    say(f"\n(files: {out})")
    failed = any(row[2] in ("FAILED", "ERROR", "error") for row in rows)
    return 1 if failed else 0


def cpu_scaling(args) -> int:
    """The CPU-only part (issue 65): benchmarks/bench_cpu_scaling.py on this host's CPUs, CUDA hidden, its table
    after the environment; `--scaling-args` go to the benchmark (docs/gpu.md has the call)."""
    started = time.monotonic()
    out, env, env_lines, _, imported = prepared(args.python, "lmi_serve.server.app, flask, gunicorn, requests")
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout if shutil.which("lscpu") else ""
    cores = subprocess.run(["lscpu", "-e=CPU,CORE,SOCKET,NODE"], capture_output=True, text=True).stdout if lscpu else ""
    (out / "lscpu.txt").write_text(lscpu + "\n" + cores)  # which CPU numbers share a core: the layouts' slices
    flags = re.search(r"Flags:\s*(.+)", lscpu)
    env_lines.append("lscpu flags: " + (flags.group(1).strip() if flags else "?"))
    say("\n## CPU scaling (benchmarks/bench_cpu_scaling.py)")
    table = out / "cpu_scaling.md"
    table.unlink(missing_ok=True)
    bench = [sys.executable, "-m", "benchmarks.bench_cpu_scaling", "--out", str(table), "--json",
             str(out / "cpu_scaling.json"), "--deadline", str(args.scaling_deadline), *args.scaling_args.split()]
    rc, took = (run_logged(bench, out / "cpu_scaling.log", dict(env, CUDA_VISIBLE_DEVICES=""), args.scaling_timeout)
                if imported else (2, 0.0))  # a server that cannot import would fail every layout the same way
    env_lines.append(f"cpu scaling: exit {rc if rc is not None else 'killed (timeout)'} in {took:.0f} s")
    body = (table.read_text() if table.is_file() else "(no table: see cpu_scaling.log)\n" if imported
            else "(not run: the server does not import here; see the WARNING above)\n")
    report = [f"# CPU scaling check, {time.strftime('%Y-%m-%d %H:%M')}, {time.monotonic() - started:.0f} s", ""]
    report += [f"- {line}" for line in env_lines] + ["", body]
    (out / "device_check_cpu.md").write_text("\n".join(report))
    say("\n" + "\n".join(report))
    say(f"(files: {out})")
    return 0 if rc == 0 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="GPU tests + GPU benchmark in one table; or, with --cpu-scaling, the "
                                            "CPU scaling table (docs/gpu.md)")
    p.add_argument("--prepare", action="store_true", help="download the wheels and SmolLM2's tokenizer here")
    p.add_argument("--python", default=TARGET_PYTHON, help=f"--prepare: the device's Python (default {TARGET_PYTHON})")
    p.add_argument("--bench-args", default="", help="extra arguments for benchmarks/bench_gpu.py")
    p.add_argument("--tests-timeout", type=int, default=GPU_TESTS_TIMEOUT_S)
    p.add_argument("--bench-timeout", type=int, default=BENCH_TIMEOUT_S)
    p.add_argument("--cpu-scaling", action="store_true",
                   help="instead of the GPU part: served tok/s per CPU layout (benchmarks/bench_cpu_scaling.py)")
    p.add_argument("--scaling-args", default="", help="extra arguments for benchmarks/bench_cpu_scaling.py")
    p.add_argument("--scaling-deadline", type=int, default=SCALING_DEADLINE_S,
                   help=f"start no layout past this many seconds of the benchmark (default {SCALING_DEADLINE_S})")
    p.add_argument("--scaling-timeout", type=int, default=SCALING_TIMEOUT_S)
    args = p.parse_args(argv)
    if args.prepare:
        return prepare(args.python)
    return cpu_scaling(args) if args.cpu_scaling else check(args)


if __name__ == "__main__":
    sys.exit(main())
