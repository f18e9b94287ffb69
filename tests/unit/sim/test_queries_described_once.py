"""Each instant query of an observation is described once (planner/queries.py): the daemon's
Observer renders the description to PromQL, the replay's Prometheus (sim/promsim.py) evaluates the
same description on its scrapes."""

from __future__ import annotations

import pytest

from fleetplan.controller.observe import _SERIES, Observer, ObserverConfig, PromClient
from fleetplan.planner.arrivals import EngineSeries
from fleetplan.planner.observation import Query
from fleetplan.planner.queries import QUERIES, Agg, By, Latest, Quantile, Rate
from fleetplan.sim.promsim import Counters, PromSim


def test_the_observer_renders_every_described_query_from_its_description() -> None:
    o = Observer(PromClient("http://p:9090"), ObserverConfig(window_s=60, model_labels=("model",)))
    rendered = o.queries()
    assert set(QUERIES) <= set(rendered)
    for q, d in QUERIES.items():
        assert rendered[q] == o.render(d)
        if isinstance(d, Rate | Latest):
            agg = d.agg.value if isinstance(d, Latest) else "sum"
            assert rendered[q].startswith(f"{agg} by ({'replica' if d.by is By.REPLICA else 'model'}) (")
            assert _SERIES[d.series] in rendered[q] and ("rate(" in rendered[q]) is isinstance(d, Rate)
        if isinstance(d, Quantile):
            assert rendered[q].startswith(f"histogram_quantile({d.q:g}, sum by (model, le) (rate(")
    # the engines' names of the series the descriptions read
    assert "prefix_cache_hits_total" in rendered[Query.PREFIX_HITS]
    assert rendered[Query.KV].startswith("avg by (model)")


def _counters(done: float, prompt: float, gen: float) -> Counters:
    c = Counters()
    c.completed, c.prompt_tokens, c.gen_tokens = done, prompt, gen
    c.prefix_queries, c.prefix_hits = prompt, prompt / 4
    c.ttft[0] = done  # every first token within the lowest bucket
    c.itl[1] = 3 * done
    return c


def test_the_replay_evaluates_the_same_descriptions_on_its_scrapes() -> None:
    p = PromSim(window_s=60.0, scrape_s=15.0, delay_s=0.0, history_s=600.0, history_step_s=30.0,
                peak_window_s=30.0, epoch0_s=1e9)
    p.set_targets([("r1", "m"), ("r2", "m")])
    for k in range(6):  # r1: 2 req/s, r2: 1 req/s; r1 queues one more request every scrape
        t = 15.0 * k
        p.scrape(t, {"r1": (_counters(2 * t, 200 * t, 50 * t), 4.0, float(k), 0.5),
                     "r2": (_counters(t, 100 * t, 25 * t), 2.0, 0.0, 0.25)})
    res = p.readings(75.0).results

    def one(q: Query, **labels: str) -> float:
        [v] = [s.value for s in res[q] if all(s.labels.get(k) == x for k, x in labels.items())]
        return v

    # Rate: the counter's increase per second over the window, summed by model
    assert one(Query.PROMPT, model="m") == pytest.approx(300.0)
    assert one(Query.GEN, model="m") == pytest.approx(75.0)
    assert one(Query.PREFIX_QUERIES, model="m") == pytest.approx(300.0)
    assert one(Query.PREFIX_HITS, model="m") == pytest.approx(75.0)
    # Latest: the targets' latest samples, summed (or averaged) by model, or per target
    assert one(Query.RUNNING, model="m") == 6.0 and one(Query.WAITING, model="m") == 5.0
    assert QUERIES[Query.KV] == Latest(EngineSeries.KV_USAGE, agg=Agg.AVG)
    assert one(Query.KV, model="m") == pytest.approx(0.375)
    assert one(Query.REPLICA_RUNNING, replica="r1") == 4.0 and one(Query.REPLICA_DONE, replica="r2") == 75.0
    # Arrivals: completions + the queue's growth (1 request per 15 s on r1)
    assert one(Query.REPLICA_RATE, replica="r1") == pytest.approx(2.0 + 1 / 15)
    assert one(Query.RATE, model="m") == pytest.approx(3.0 + 1 / 15)
    # Quantile: of the summed bucket rates
    assert one(Query.TTFT_P99, model="m") > 0 and one(Query.ITL_P50, model="m") > one(Query.TTFT_P50, model="m")
