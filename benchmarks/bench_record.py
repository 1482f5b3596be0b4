"""What recording every step (``LLMEngine(record=...)``, ``vkv demo --record``) costs a run.

One engine serves ``vkv bench e2e``'s workload (64 requests, windows of the pinned corpus,
prompts and outputs of 16 to 256 tokens, greedy, ``ignore_eos``; the CPU pool of 256 MiB) with
the recorder off and on, in pairs whose order alternates (off-on, on-off, ...), so that both
sides see the same machine. The figures: the median over the pairs of the run time with the
recording over the run time without it (on a shared machine the runs' own noise, several per
cent, can exceed the cost), and the time spent inside ``Recorder.record`` as a share of the
recorded runs (the cost itself, timed where it is paid); the recording's size is also given.

    uv run python benchmarks/bench_record.py [--pairs 4] [--out DIR]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from vkv.bench import Workload, run_vkv
from vkv.engine.llm_engine import LLMEngine
from vkv.models.loader import DEFAULT_MODEL
from vkv.recording import Recorder, RecordingFile


class TimedRecorder(Recorder):
    """A ``Recorder`` that adds up the seconds its ``record`` takes."""

    seconds = 0.0

    def record(self, engine, out) -> None:
        started = time.perf_counter()
        super().record(engine, out)
        self.seconds += time.perf_counter() - started


def run_once(engine: LLMEngine, workload: Workload, record: Path | None) -> tuple[float, float]:
    """One run of the workload: its seconds, and those spent recording (0 without)."""
    sink = RecordingFile(record) if record else None
    engine.recorder = TimedRecorder(engine, sink) if sink else None
    try:
        seconds = run_vkv(engine, workload).seconds
        recording = engine.recorder.seconds if sink else 0.0
    finally:
        engine.recorder = None
        if sink is not None:
            sink.close()
    return seconds, recording


def measure(pairs: int) -> dict:
    engine = LLMEngine(DEFAULT_MODEL, max_num_seqs=64, device="cpu")
    workload = Workload.mixed(lambda text: engine.tokenizer.encode(text).ids)
    run_vkv(engine, Workload(workload.prompts[:2], [4, 4]))  # warm-up
    ratios, plain, recorded, shares = [], [], [], []
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "run.jsonl"
        for pair in range(pairs):
            order = (None, path) if pair % 2 == 0 else (path, None)
            times = {}
            for record in order:
                seconds, recording = run_once(engine, workload, record)
                times[record is not None] = seconds
                if record is not None:
                    shares.append(recording / seconds)
            ratios.append(times[True] / times[False])
            plain.append(times[False])
            recorded.append(times[True])
        size = path.stat().st_size
    return {
        "pairs": pairs,
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "recording_share_median": statistics.median(shares),
        "seconds_without": statistics.median(plain),
        "seconds_with": statistics.median(recorded),
        "recording_bytes": size,
        "gpu_blocks": engine.config.num_gpu_blocks,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    summary = measure(args.pairs)
    print(
        f"recording on / off, median of {args.pairs} pairs: {summary['ratio_median']:.3f}x "
        f"(each pair: {', '.join(f'{r:.3f}' for r in summary['ratios'])}); "
        f"time inside Recorder.record: {summary['recording_share_median']:.1%} of a run; "
        f"{summary['seconds_without']:.1f} s without, {summary['seconds_with']:.1f} s with; "
        f"recording {summary['recording_bytes'] / 2**20:.1f} MiB for a pool of "
        f"{summary['gpu_blocks']} blocks"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_record.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
