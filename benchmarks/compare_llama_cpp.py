"""servelab against llama.cpp at batch 1 on this CPU: decode and prefill tokens/s, same
model, same threads, alternating runs.

llama.cpp is a reference here, never a dependency: the script builds it from the sources
vendored in the ``llama-cpp-python`` sdist (downloaded with pip into ``--workdir`` unless
``--sdist`` names one) with ``GGML_NATIVE=ON``, and converts servelab's random checkpoints
(``servelab.bench.random_llama``) with the vendored ``convert_hf_to_gguf.py``. The
checkpoints' word-level tokenizer is not one llama.cpp reads, so the converted copy carries
a SentencePiece model with one piece per id, which the converter is made to read for every
architecture (the weights and ids are the same; only the text a token decodes to differs). Modes and their llama.cpp counterparts:

- ``float32`` / ``bfloat16``: GGUF ``f32`` / ``bf16``;
- ``int8`` (weight-only) and ``w8a8`` (servelab: LM head in int8 too): ``q8_0`` (int8
  weights in blocks of 32 with a scale; llama.cpp multiplies them with int8 activations);
- ``int4`` (servelab: groups of 128, float32 head; ``int4-head``: an int8 head;
  ``int4-head4``: an int4 head) and ``w4a8`` (int4 weights with int8 activations, an int8
  head with int8 activations; ``w4a8-head4``: an int4 head): ``Q4_0`` by
  ``llama-quantize`` from the ``f32`` file (blocks of 32 with a scale, 4.5 bits a weight as
  servelab's groups of 128 with a scale and a zero; llama.cpp multiplies them with int8
  activations; llama-quantize keeps the output matrix at Q6_K).

Each repeat measures servelab (offline ``LLM``, one request: 16-token prompt then 128
tokens, decode tokens/s = 127 / (last token time - first token time); a 256-token prompt
alone, prefill tokens/s = 256 / its time to first token; before them an untimed 8-token
request, as llama-bench warms up) and then ``llama-bench -t THREADS -p 256 -n 128 -r 1``
(tg128 and pp256, after its own warm-up). The table gives medians and every run.

    python benchmarks/compare_llama_cpp.py --models 26m 05b --modes float32 w8a8 --repeats 3
    python benchmarks/compare_llama_cpp.py --models 26m --modes w8a8 --overrides decoding.multi_step=8
    python benchmarks/compare_llama_cpp.py --prepare-only --models 26m --modes float32

Online, the same build and GGUF file serve ``llama-server`` against ``servelab-serve``
under Poisson load: ``benchmarks/compare_vllm_online.py --servers servelab llama.cpp
--llama-cpp-dir WORKDIR/build --gguf FILE`` (the paths this script prints).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from decode_roofline import overrides_for  # the sibling script's modes

from servelab.bench.random_llama import MAX_POSITIONS, MODELS, make_checkpoint
from servelab.bench.report import render_markdown

SDIST_VERSION = "0.3.36"
PROMPT_TOKENS, DECODE_TOKENS, PREFILL_TOKENS = 16, 128, 256
WARM_UP_TOKENS = 8
"""The untimed request before each timed servelab run decodes this many tokens."""
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "int8": "q8_0", "w8a8": "q8_0", "int4": "q4_0",
              "int4-head": "q4_0", "int4-head4": "q4_0", "w4a8": "q4_0", "w4a8-head4": "q4_0"}
"""The GGUF weight type each servelab mode is compared with."""
TOOLS = ("llama-bench", "llama-server", "llama-quantize")
CONVERT = (
    "import runpy, sys\n"
    "source = sys.argv.pop(1)\n"
    "sys.path.insert(0, source)\n"
    "from conversion import base\n"
    "base.TextModel.set_vocab = base.TextModel._set_vocab_sentencepiece\n"
    "sys.argv[0] = source + '/convert_hf_to_gguf.py'\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)
"""``convert_hf_to_gguf.py`` reading every architecture's vocabulary from ``tokenizer.model``
(Llama's converter does already; Qwen3-MoE's would look for a byte-level BPE tokenizer)."""


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Run ``command``, raising with the end of its output when it fails."""
    result = subprocess.run(command, capture_output=True, text=True, errors="replace", check=False, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, command))} failed ({result.returncode}):\n"
                           f"{(result.stdout + result.stderr)[-3000:]}")
    return result


def llama_cpp_sources(workdir: Path, sdist: Path | None) -> Path:
    """The llama.cpp tree vendored in the ``llama-cpp-python`` sdist, extracted under ``workdir``."""
    if sdist is None:
        sdist = workdir / f"llama_cpp_python-{SDIST_VERSION}.tar.gz"
        if not sdist.exists():
            run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(workdir),
                 f"llama-cpp-python=={SDIST_VERSION}"])
    root = workdir / sdist.name.removesuffix(".tar.gz")
    if not root.exists():
        with tarfile.open(sdist) as archive:
            archive.extractall(workdir, filter="data")
    return root / "vendor" / "llama.cpp"


def build_llama_cpp(source: Path, build: Path, jobs: int) -> Path:
    """``llama-bench``, ``llama-server`` and ``llama-quantize`` built for this CPU
    (``GGML_NATIVE=ON``, release) without AMX code; returns the folder holding them.

    ggml's AMX kernels (batched Q8_0/Q4_0 matmuls) die with SIGILL at their first
    ``tileloadd`` on the project's AMX VMs, so the build leaves them out
    (``-mno-amx-*``); llama.cpp then multiplies those batches with AVX-512 VNNI."""
    binaries = build / "bin"
    if all((binaries / tool).exists() for tool in TOOLS):
        return binaries
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    run(["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
         f"-DCMAKE_C_FLAGS={no_amx}", f"-DCMAKE_CXX_FLAGS={no_amx}", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"])
    run(["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs), "--target", *TOOLS])
    return binaries


def sentencepiece_packages(workdir: Path) -> Path:
    """A folder with the ``sentencepiece`` package (the converter's SentencePiece reader)
    and the ``protobuf`` its model file needs, installed there and not into servelab's
    environment."""
    target = workdir / "converter-packages"
    if not ((target / "sentencepiece").exists() and (target / "google" / "protobuf").exists()):
        run([sys.executable, "-m", "pip", "install", "--quiet", "--target", str(target), "sentencepiece", "protobuf"])
    return target


def sentencepiece_model(vocab_size: int, packages: Path) -> bytes:
    """A serialized SentencePiece unigram model with one piece per id: ``<s>`` (0, BOS),
    ``</s>`` (1, EOS), ``<unk>`` (2), then ``<i>``."""
    sys.path.insert(0, str(packages))
    try:
        from sentencepiece import sentencepiece_model_pb2 as model_pb2
    finally:
        sys.path.remove(str(packages))
    model = model_pb2.ModelProto()
    model.trainer_spec.model_type = model_pb2.TrainerSpec.UNIGRAM
    model.trainer_spec.vocab_size = vocab_size
    model.trainer_spec.bos_id, model.trainer_spec.eos_id, model.trainer_spec.unk_id = 0, 1, 2
    model.trainer_spec.pad_id = -1
    kinds = {0: model_pb2.ModelProto.SentencePiece.CONTROL, 1: model_pb2.ModelProto.SentencePiece.CONTROL,
             2: model_pb2.ModelProto.SentencePiece.UNKNOWN}
    for i in range(vocab_size):
        piece = model.pieces.add()
        piece.piece = {0: "<s>", 1: "</s>", 2: "<unk>"}.get(i, f"\u2581<{i}>")
        piece.score = -float(i)
        piece.type = kinds.get(i, model_pb2.ModelProto.SentencePiece.NORMAL)
    return model.SerializeToString()


def gguf_file(folder: Path, mode: str, source: Path, binaries: Path, packages: Path) -> Path:
    """The GGUF file of the checkpoint in ``folder`` at ``mode``'s llama.cpp weight type,
    converted (and quantized for Q4_0) once."""
    kind = GGUF_TYPES[mode]
    target = folder.parent / f"{folder.name}-{kind}.gguf"
    if target.exists():
        return target
    if kind == "q4_0":
        full = gguf_file(folder, "float32", source, binaries, packages)
        run([str(binaries / "llama-quantize"), str(full), str(target), "Q4_0"])
        return target
    copy = folder.parent / f"{folder.name}-spm"
    if not (copy / "tokenizer.model").exists():  # written last: an interrupted copy is made again
        shutil.rmtree(copy, ignore_errors=True)
        copy.mkdir()
        for name in os.listdir(folder):
            if name.endswith(".safetensors") or name in ("config.json", "generation_config.json"):
                (copy / name).symlink_to(folder / name)
        vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
        (copy / "tokenizer.model").write_bytes(sentencepiece_model(vocab_size, packages))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(packages), str(source / "gguf-py")]))
    run([sys.executable, "-c", CONVERT, str(source), str(copy), "--outtype", kind, "--outfile", str(target)], env=env)
    return target


def servelab_batch1(llm) -> dict[str, float]:
    """One request's decode tokens/s (16-token prompt, 128 tokens) and one 256-token
    prompt's prefill tokens/s, offline, after an untimed request of a few tokens (as
    ``llama-bench`` warms up before each test: the run before was the other engine's, whose
    working set has taken the caches)."""
    from servelab import SamplingParams

    request = [[2 + j for j in range(PROMPT_TOKENS)]]
    llm.generate(request, SamplingParams(temperature=0.0, max_tokens=WARM_UP_TOKENS, ignore_eos=True),
                 use_tqdm=False)
    decode = llm.generate(request, SamplingParams(temperature=0.0, max_tokens=DECODE_TOKENS, ignore_eos=True),
                          use_tqdm=False)
    times = decode[0].metrics.token_times
    prompt = [[2 + (j * 7) % 1000 for j in range(PREFILL_TOKENS)]]
    prefill = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    metrics = prefill[0].metrics
    return {"decode": (len(times) - 1) / (times[-1] - times[0]),
            "prefill": PREFILL_TOKENS / (metrics.token_times[0] - metrics.arrival_time)}


def llama_bench(binaries: Path, gguf: Path, threads: int) -> dict[str, float]:
    """``llama-bench``'s tg128 and pp256 tokens/s (one repetition after its warm-up)."""
    result = run([str(binaries / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(PREFILL_TOKENS),
                  "-n", str(DECODE_TOKENS), "-r", "1", "-o", "json"])
    rows = json.loads(result.stdout)
    return {"decode": next(r["avg_ts"] for r in rows if r["n_gen"] > 0),
            "prefill": next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)}


def compare(name: str, mode: str, folder: Path, gguf: Path, binaries: Path, args: argparse.Namespace) -> list[list]:
    """Table rows (servelab, llama.cpp) for one model and mode."""
    from servelab import LLM

    llm = LLM(str(folder), overrides=["device=cpu", f"model.max_model_len={MAX_POSITIONS}",
                                      f"parallel.threads={args.threads}", *overrides_for(mode), *args.overrides])
    llm.warm_up()
    runs: dict[str, list[dict[str, float]]] = {"servelab": [], "llama.cpp": []}
    for _ in range(args.repeats):
        runs["servelab"].append(servelab_batch1(llm))
        runs["llama.cpp"].append(llama_bench(binaries, gguf, args.threads))
        print(f"  {name} {mode}: servelab {runs['servelab'][-1]}, llama.cpp {runs['llama.cpp'][-1]}", flush=True)
    llm.shutdown()
    rows = []
    for engine, measured in runs.items():
        label = " ".join([mode, *args.overrides]) if engine == "servelab" else GGUF_TYPES[mode]
        rows.append([name, label, engine,
                     *(f"{statistics.median(r[k] for r in measured):.1f}" for k in ("decode", "prefill")),
                     " ".join(f"{r['decode']:.0f}/{r['prefill']:.0f}" for r in measured)])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["26m"], choices=sorted(MODELS))
    parser.add_argument("--modes", nargs="+", default=["float32"], choices=sorted(GGUF_TYPES))
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per engine")
    parser.add_argument("--sdist", type=Path, help="a llama-cpp-python sdist (default: pip downloads "
                        f"llama-cpp-python=={SDIST_VERSION} into --workdir)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "servelab-llama-cpp")
    parser.add_argument("--prepare-only", action="store_true",
                        help="build llama.cpp and convert the models, print the paths, measure nothing")
    parser.add_argument("--overrides", nargs="*", default=[],
                        help="more servelab config overrides for every run (decoding.multi_step=8, say)")
    parser.add_argument("--out", type=Path, help="write the table's runs here as JSON")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source = llama_cpp_sources(args.workdir, args.sdist)
    binaries = build_llama_cpp(source, args.workdir / "build", args.threads)
    packages = sentencepiece_packages(args.workdir)
    print(f"llama.cpp tools: {binaries}")
    rows = []
    for name in args.models:
        folder = Path(make_checkpoint(str(args.workdir / name), name))
        for mode in args.modes:
            gguf = gguf_file(folder, mode, source, binaries, packages)
            print(f"{name} {mode}: {folder} (servelab), {gguf} (llama.cpp)", flush=True)
            if not args.prepare_only:
                rows.extend(compare(name, mode, folder, gguf, binaries, args))
    if rows:
        print(f"\nbatch 1, {args.threads} threads, {args.repeats} alternating run(s) per engine; medians (decode: "
              f"{DECODE_TOKENS} tokens after a {PROMPT_TOKENS}-token prompt; prefill: {PREFILL_TOKENS} tokens)")
        print(render_markdown(["model", "weights", "engine", "decode tok/s", "prefill tok/s",
                               "runs (decode/prefill)"], rows, align="lllrrl"), end="")
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
