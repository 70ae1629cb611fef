"""Render the Grafana dashboard's main panels to a PNG from a series of /metrics scrapes.

Three ways to get scrapes:
  python bench/render_dashboard.py                          # simulate an engine (SYNTHETIC data)
  python bench/render_dashboard.py --record http://127.0.0.1:8000/metrics --duration 600 --save scrapes.json
  python bench/render_dashboard.py --scrapes scrapes.json   # re-render a recording

A scrape file is JSON: {"source": str, "scrapes": [{"t": seconds, "text": exposition}, ...]}.
The panel math mirrors the dashboard's PromQL (rate over a window, sum, histogram_quantile with
Prometheus' linear interpolation); panel titles are those of deploy/grafana/dashboards/specserve.json.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
import urllib.request
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

P = "specserve:"
RATE_WINDOW_S = 30.0   # like Grafana's $__rate_interval at a 5 s scrape interval


# ---------------------------------------------------------------------------- scrapes -> series

class Series:
    """Parsed scrapes with the few PromQL operations the panels need, evaluated at every scrape."""

    def __init__(self, scrapes: list[dict]):
        self.t = [s["t"] - scrapes[0]["t"] for s in scrapes]
        self.samples = []   # per scrape: {name: [(labels, value)]}
        for scrape in scrapes:
            by_name = defaultdict(list)
            for family in text_string_to_metric_families(scrape["text"]):
                for s in family.samples:
                    by_name[s.name].append((s.labels, s.value))
            self.samples.append(by_name)

    def _sum(self, i: int, name: str, by: str | None = None) -> dict:
        out = defaultdict(float)
        for labels, value in self.samples[i].get(P + name, []):
            out[labels.get(by) if by else None] += value
        return out

    def gauge(self, name: str, agg=sum) -> list[float]:
        out = []
        for by_name in self.samples:
            values = [v for _, v in by_name.get(P + name, [])]
            out.append(agg(values) if values else math.nan)
        return out

    def _window_start(self, i: int) -> int | None:
        j = i
        while j > 0 and self.t[i] - self.t[j - 1] <= RATE_WINDOW_S:
            j -= 1
        return j if j < i else None

    def rate(self, name: str, by: str | None = None) -> dict:
        """{label value: [per-second rate at each scrape]} of sum by (by) (rate(name[window]))."""
        out = defaultdict(lambda: [math.nan] * len(self.t))
        for i in range(len(self.t)):
            j = self._window_start(i)
            if j is None:
                continue
            now, before = self._sum(i, name, by), self._sum(j, name, by)
            for key, value in now.items():
                delta = value - before.get(key, 0.0)
                out[key][i] = delta / (self.t[i] - self.t[j]) if delta >= 0 else math.nan   # reset: skip
        return dict(out)

    def rate1(self, name: str) -> list[float]:
        return self.rate(name).get(None, [math.nan] * len(self.t))

    def quantile(self, q: float, histogram: str) -> list[float]:
        buckets = self.rate(histogram + "_bucket", by="le")
        bounds = sorted(buckets, key=float)
        return [_histogram_quantile(q, [(float(le), buckets[le][i]) for le in bounds]) for i in range(len(self.t))]


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, rate) pairs, +Inf last."""
    if len(buckets) < 2 or any(math.isnan(c) for _, c in buckets) or buckets[-1][1] <= 0:
        return math.nan
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower
            return lower + (upper - lower) * (rank - below) / (count - below) if count > below else upper
        lower, below = upper, count
    return math.nan


def ratio(a: list[float], b: list[float]) -> list[float]:
    return [x / y if y and not math.isnan(x) and not math.isnan(y) else math.nan for x, y in zip(a, b)]


def mean(s: Series, histogram: str) -> list[float]:
    return ratio(s.rate1(histogram + "_sum"), s.rate1(histogram + "_count"))


def _per_position(s: Series):
    drafts = s.rate1("spec_decode_num_drafts_total")
    by_pos = s.rate("spec_decode_num_accepted_tokens_per_pos_total", by="position")
    return [(f"position {pos}", ratio(by_pos[pos], drafts)) for pos in sorted(by_pos, key=int)]


def _tokens_per_forward(s: Series):
    forwards = s.rate1("spec_decode_num_target_forwards_total")
    accepted = s.rate1("spec_decode_num_accepted_tokens_total")
    return ratio([a + f for a, f in zip(accepted, forwards)], forwards)


def _quantiles(histogram: str, extra=()):
    return lambda s: [(f"p{round(q * 100)}", s.quantile(q, histogram)) for q in (0.5, 0.9, 0.99)] + [
        (label, fn(s)) for label, fn in extra]


# title -> (unit, function(Series) -> [(legend, values)]), in display order.
PANELS = {
    "Draft acceptance rate": ("percent", lambda s: [
        ("rate interval", ratio(s.rate1("spec_decode_num_accepted_tokens_total"), s.rate1("spec_decode_num_draft_tokens_total"))),
        ("engine, last 64 steps", s.gauge("spec_decode_acceptance_rate", agg=lambda v: sum(v) / len(v)))]),
    "Mean accepted length": ("tokens", lambda s: [
        ("accepted drafts / verification", mean(s, "spec_decode_accepted_length")),
        ("tokens / target forward", _tokens_per_forward(s))]),
    "Acceptance by draft position": ("percent", _per_position),
    "Estimated speedup": ("x", lambda s: [
        ("speedup", s.gauge("spec_decode_estimated_speedup", agg=lambda v: sum(v) / len(v)))]),
    "Drafting vs verification time per step": ("s", lambda s: [
        ("draft", mean(s, "spec_decode_draft_time_seconds")),
        ("verify", mean(s, "spec_decode_verify_time_seconds"))]),
    "Tokens/s": ("tok/s", lambda s: [
        ("prompt (prefill)", s.rate1("prompt_tokens_total")), ("generation", s.rate1("generation_tokens_total"))]),
    "Time to first token": ("s", _quantiles("time_to_first_token_seconds")),
    "Inter-token latency": ("s", _quantiles("inter_token_latency_seconds")),
    "End-to-end request latency": ("s", _quantiles("e2e_request_latency_seconds", [
        ("queue p90", lambda s: s.quantile(0.9, "request_queue_time_seconds"))])),
    "Running and waiting requests": ("requests", lambda s: [
        ("running", s.gauge("num_requests_running")), ("waiting", s.gauge("num_requests_waiting"))]),
    "KV cache usage": ("percent", lambda s: [("used", s.gauge("kv_cache_usage_perc", agg=max))]),
    "Batch size": ("", lambda s: [
        ("mean requests / step", mean(s, "batch_size")), ("p90 requests / step", s.quantile(0.9, "batch_size"))]),
    "Finished requests/s": ("req/s", lambda s: sorted(
        (reason, values) for reason, values in s.rate("request_success_total", by="finished_reason").items()
        if any(v > 0 for v in values if not math.isnan(v)))),
    "Preemptions/s": ("1/s", lambda s: [("preemptions", s.rate1("num_preemptions_total"))]),
    "Draft and accepted tokens/s": ("tok/s", lambda s: [
        ("proposed", s.rate1("spec_decode_num_draft_tokens_total")),
        ("accepted", s.rate1("spec_decode_num_accepted_tokens_total"))]),
}


# ---------------------------------------------------------------------------- drawing

COLORS = ["#73BF69", "#F2CC0C", "#5794F2", "#FF9830", "#F2495C", "#B877D9", "#8AB8FF"]
BACKGROUND, PANEL, TEXT, GRID = "#111217", "#181b1f", "#ccccdc", "#2c3235"


def _format(unit: str):
    def fmt(value, _pos=None):
        if unit == "percent":
            return f"{value * 100:.0f}%"
        if unit == "s":
            return f"{value * 1000:.0f} ms" if abs(value) < 1 else f"{value:.1f} s"
        if unit == "x":
            return f"{value:.2f}x"
        return f"{value / 1000:.1f}k" if abs(value) >= 1000 else f"{value:.3g}"
    return fmt


def render(scrapes: list[dict], out: Path, title: str, dashboard_path: Path | None = None, columns: int = 3) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    if dashboard_path is not None:   # draw only panels the dashboard really has
        panels = json.loads(Path(dashboard_path).read_text())["panels"]
        titles = {p["title"] for p in panels} | {q["title"] for p in panels for q in p.get("panels", [])}
        missing = set(PANELS) - titles
        if missing:
            raise SystemExit(f"panels not in the dashboard: {sorted(missing)}")
    series = Series(scrapes)
    minutes = [t / 60 for t in series.t]
    rows = math.ceil(len(PANELS) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.2 * columns, 3.3 * rows + 0.9), facecolor=BACKGROUND)
    for ax, (panel_title, (unit, compute)) in zip(axes.flat, PANELS.items()):
        ax.set_facecolor(PANEL)
        for spine in ax.spines.values():
            spine.set_color(GRID)
        ax.tick_params(colors=TEXT, labelsize=8)
        ax.grid(color=GRID, linewidth=0.6)
        ax.set_title(panel_title, color=TEXT, fontsize=11, loc="left", fontweight="bold")
        for k, (label, values) in enumerate(compute(series)):
            ax.plot(minutes, values, color=COLORS[k % len(COLORS)], linewidth=1.6, label=label)
        top = max((v for line in ax.get_lines() for v in line.get_ydata() if not math.isnan(v)), default=0.0)
        ax.set_ylim(0, (1.0 if unit == "percent" or top <= 0 else top) * 1.3)   # headroom for the legend
        ax.yaxis.set_major_formatter(FuncFormatter(_format(unit)))
        if unit == "percent":
            ax.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        else:
            ax.yaxis.set_major_locator(MaxNLocator(5))
        ax.set_xlim(0, minutes[-1])
        ax.set_xlabel("minutes", color=TEXT, fontsize=8)
        legend = ax.legend(loc="upper left", fontsize=7.5, frameon=False, ncol=3)
        for text in legend.get_texts():
            text.set_color(TEXT)
    for ax in list(axes.flat)[len(PANELS):]:
        ax.set_visible(False)
    fig.suptitle(title, color=TEXT, fontsize=15, fontweight="bold", x=0.01, ha="left", y=0.995)
    # Fixed margins (tight_layout would cost a second full draw).
    height = fig.get_figheight()
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.45 / height, top=1 - 0.95 / height, wspace=0.14, hspace=0.42)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, facecolor=BACKGROUND)
    plt.close(fig)


# ---------------------------------------------------------------------------- synthetic engine

def simulate(duration_s: float = 900.0, scrape_interval_s: float = 5.0, seed: int = 0, gamma: int = 4) -> list[dict]:
    """Drive server.metrics.Metrics with a simulated draft-model engine on a simulated clock.

    SYNTHETIC: step costs, acceptance and traffic are made-up but plausible numbers for a 7-8B
    target with a ~0.5B draft on one GPU: a plain decode step of ~15 ms, verification ~1.2x that,
    acceptance per position decaying from ~0.8 (code-like traffic) and dropping to ~0.6 after the
    traffic mix changes halfway; load ramps up to a burst that queues and preempts, then eases.
    """
    from engine.outputs import RequestOutput, RequestTiming, StepStats
    from server.metrics import Metrics

    rng = random.Random(seed)
    metrics = Metrics("llama-3.1-8b-instruct", "draft")
    max_seqs, budget, block, total_blocks = 64, 2048, 16, 2000
    clock, next_arrival, next_scrape = 0.0, 0.0, 0.0
    waiting, running, scrapes = [], [], []

    def arrival_rate(t: float) -> float:   # requests/s
        f = t / duration_s
        return 1.0 + 7.0 * min(1.0, max(0.0, (f - 0.1) / 0.35)) + (4.0 if 0.5 <= f < 0.6 else 0.0) - (
            5.0 * min(1.0, max(0.0, (f - 0.72) / 0.08)))

    def blocks(r) -> int:
        return -(-(r["prompt"] + r["done"] + gamma + 1) // block)

    while clock < duration_s:
        while next_arrival <= clock:
            waiting.append({"id": len(scrapes) * 1000 + rng.randrange(10**6), "arrival": next_arrival,
                            "prompt": min(int(rng.lognormvariate(5.6, 0.7)) + 16, 1536), "target": rng.randint(48, 640),
                            "stop_at": rng.randint(32, 640) if rng.random() < 0.7 else None, "done": 0,
                            "scheduled": None, "first": None, "last": None, "prefilled": False})
            next_arrival += rng.expovariate(max(arrival_rate(next_arrival), 0.05))
        # Schedule: keep the running set, admit waiting requests while seats, budget and KV allow.
        preempted, prompt_tokens = 0, 0
        used = sum(blocks(r) for r in running)
        while used > total_blocks and running:   # KV exhausted: preempt the newest request
            victim = running.pop()
            used -= blocks(victim)
            victim["prefilled"] = False   # its KV is gone: prompt and output are prefilled again
            waiting.insert(0, victim)
            preempted += 1
        tokens_left = budget - len(running) * (gamma + 1)
        while waiting and len(running) < max_seqs and (not running or (
                waiting[0]["prompt"] + waiting[0]["done"] <= tokens_left and used + blocks(waiting[0]) <= total_blocks * 0.97)):
            r = waiting.pop(0)
            running.append(r)
            used += blocks(r)
            tokens_left -= r["prompt"] + r["done"]
            prompt_tokens += r["prompt"] + r["done"]
            r["scheduled"] = r["scheduled"] if r["scheduled"] is not None else clock
        if not running:
            clock = max(clock + 0.01, min(next_arrival, duration_s))
        decoding = [r for r in running if r["prefilled"]]
        b = len(running)
        alpha = 0.8 if clock < duration_s * 0.7 else 0.6   # the traffic mix changes
        plain = 0.0135 + 0.00011 * b
        draft_time = gamma * (0.0022 + 0.00002 * b) if decoding else 0.0
        verify = plain * (1.12 + 0.004 * len(decoding)) + prompt_tokens * 0.00006 if b else 0.0
        step_time = draft_time + verify + 0.0008 * rng.random()
        clock += step_time if b else 0.0
        per_pos, lengths, emitted, finished = [0] * gamma, [], 0, []
        for r in running:
            if not r["prefilled"]:   # prefill step: emits the first token
                r["prefilled"], gained = True, 1
            else:
                accepted = 0
                while accepted < gamma and rng.random() < alpha * 0.96 ** accepted:
                    per_pos[accepted] += 1
                    accepted += 1
                lengths.append(accepted)
                gained = accepted + 1
            end = min(r["target"], r["stop_at"] or r["target"])
            gained = min(gained, end - r["done"])
            r["done"] += gained
            emitted += gained
            if r["first"] is None:
                r["first"] = clock
            elif r["last"] is not None:
                metrics.observe_token_gap(clock - r["last"])
            r["last"] = clock
            if r["done"] >= end:
                finished.append(r)
                reason = "stop" if r["stop_at"] and r["stop_at"] <= r["target"] else "length"
                metrics.observe_request(RequestOutput(str(r["id"]), [], True, reason, timing=RequestTiming(
                    r["arrival"], r["scheduled"], r["first"], clock)))
        for r in finished:
            running.remove(r)
        if b:
            metrics.observe_step(StepStats(
                method="draft", num_running=len(running), num_waiting=len(waiting),
                kv_cache_usage=min(1.0, sum(blocks(r) for r in running) / total_blocks), batch_size=b,
                num_batched_tokens=prompt_tokens + len(decoding) * (gamma + 1), num_preemptions=preempted,
                num_prompt_tokens=prompt_tokens, num_generation_tokens=emitted, num_drafts=len(decoding),
                num_draft_tokens=gamma * len(decoding), num_accepted_tokens=sum(lengths),
                num_target_forwards=len(decoding), accepted_per_position=tuple(per_pos),
                accepted_lengths=tuple(lengths), draft_time_s=draft_time, verify_time_s=verify,
                plain_step_time_s=plain * (1 + 0.03 * (rng.random() - 0.5)) if decoding else None))
        while next_scrape <= clock and next_scrape <= duration_s:
            scrapes.append({"t": next_scrape, "text": metrics.render().decode()})
            next_scrape += scrape_interval_s
    return scrapes


# ---------------------------------------------------------------------------- recording

def record(url: str, duration_s: float, interval_s: float) -> list[dict]:
    """Scrape a running server's /metrics every interval (use a loopback URL)."""
    scrapes, start = [], time.monotonic()
    while time.monotonic() - start <= duration_s:
        tick = time.monotonic()
        with urllib.request.urlopen(url, timeout=interval_s) as response:
            scrapes.append({"t": tick - start, "text": response.read().decode()})
        time.sleep(max(0.0, interval_s - (time.monotonic() - tick)))
    return scrapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--scrapes", type=Path, help="render a recorded scrape file")
    source.add_argument("--record", metavar="URL", help="record a server's /metrics first")
    parser.add_argument("--duration", type=float, default=900.0, help="seconds to record or simulate")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between scrapes")
    parser.add_argument("--save", type=Path, help="write the scrapes used to this JSON file")
    parser.add_argument("--title", help="figure title")
    parser.add_argument("-o", "--out", type=Path, default=ROOT / "docs" / "dashboard.png")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.scrapes:
        data = json.loads(args.scrapes.read_text())
        scrapes, label = data["scrapes"], data.get("source", str(args.scrapes))
    elif args.record:
        scrapes, label = record(args.record, args.duration, args.interval), f"recorded from {args.record}"
    else:
        scrapes = simulate(args.duration, args.interval, args.seed)
        label = "SYNTHETIC DATA: simulated engine steps fed to server/metrics.py, not a real server"
    if args.save:
        args.save.write_text(json.dumps({"source": label, "scrapes": scrapes}))
    title = args.title or f"specserve: speculative decoding  |  {label}"
    render(scrapes, args.out, title, ROOT / "deploy" / "grafana" / "dashboards" / "specserve.json")
    print(f"{len(scrapes)} scrapes -> {args.out}")


if __name__ == "__main__":
    main()
