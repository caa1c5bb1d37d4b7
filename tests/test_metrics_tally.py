"""The per-request figures are plain counts rendered at scrape (service.metrics._Tally): they
must read exactly as prometheus_client's own Counter and Histogram would have."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.metrics import HTTP_BUCKETS, Metrics

ROUTES = ("/v1/questions/{id}", "/healthz", "unmatched")
Sample = tuple[str, frozenset[tuple[str, str]], float]

requests = st.lists(
    st.tuples(
        st.sampled_from(ROUTES),
        st.sampled_from(("GET", "POST", "BREW")),
        st.sampled_from((200, 404, 503)),
        # Every bucket bound itself (an observation equal to `le` counts in it), and in between.
        st.one_of(st.sampled_from(HTTP_BUCKETS), st.floats(min_value=0, max_value=100)),
    ),
    max_size=40,
)


def samples(text: bytes, *names: str) -> set[Sample]:
    return {
        (s.name, frozenset(s.labels.items()), s.value)
        for family in text_string_to_metric_families(text.decode())
        if family.name in names
        for s in family.samples
    }


@given(requests)
def test_http_figures_read_as_prometheus_clients_own_counter_and_histogram(
    done: list[tuple[str, str, int, float]],
) -> None:
    metrics = Metrics()
    reference = CollectorRegistry()
    counter = Counter("qs_http_requests", "", ["route", "method", "status"], registry=reference)
    histogram = Histogram(
        "qs_http_request_duration_seconds", "", ["route", "method"], buckets=HTTP_BUCKETS, registry=reference
    )
    for route, method, status, seconds in done:
        metrics.http_done(route, method, status, seconds)
        label = method if method != "BREW" else "other"
        counter.labels(route, label, str(status)).inc()
        histogram.labels(route, label).observe(seconds)
    names = ("qs_http_requests", "qs_http_request_duration_seconds")
    ours, _ = metrics.render("")
    assert samples(ours, *names) == samples(generate_latest(reference), *names)
