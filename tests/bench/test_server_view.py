"""`sits.bench.server_view`: the per-tenant summary of a server's /metrics text."""

from __future__ import annotations

from sits.bench.server_view import format_view, summarize

METRICS = """\
# HELP sits:tenant_time_to_first_token_seconds Time to first token per engine request.
# TYPE sits:tenant_time_to_first_token_seconds histogram
sits:tenant_time_to_first_token_seconds_bucket{le="0.1",model_name="m",tenant="gold"} 3.0
sits:tenant_time_to_first_token_seconds_bucket{le="+Inf",model_name="m",tenant="gold"} 4.0
sits:tenant_time_to_first_token_seconds_count{model_name="m",tenant="gold"} 4.0
sits:tenant_time_to_first_token_seconds_sum{model_name="m",tenant="gold"} 1.2
sits:tenant_time_to_first_token_seconds_bucket{le="+Inf",model_name="m",tenant="burst"} 0.0
sits:tenant_time_to_first_token_seconds_count{model_name="m",tenant="burst"} 0.0
sits:tenant_time_to_first_token_seconds_sum{model_name="m",tenant="burst"} 0.0
# HELP sits:tenant_http_time_to_first_token_seconds From receipt.
# TYPE sits:tenant_http_time_to_first_token_seconds histogram
sits:tenant_http_time_to_first_token_seconds_bucket{le="+Inf",model_name="m",tenant="gold"} 4.0
sits:tenant_http_time_to_first_token_seconds_count{model_name="m",tenant="gold"} 4.0
sits:tenant_http_time_to_first_token_seconds_sum{model_name="m",tenant="gold"} 1.6
# HELP sits:tenant_slo_requests Requests measured against the tenant's SLO (by slo: ttft, tpot).
# TYPE sits:tenant_slo_requests counter
sits:tenant_slo_requests_total{model_name="m",slo="ttft",tenant="gold"} 4.0
sits:tenant_slo_requests_total{model_name="m",slo="tpot",tenant="gold"} 4.0
# HELP sits:tenant_slo_met Requests that met the tenant's SLO (by slo: ttft, tpot).
# TYPE sits:tenant_slo_met counter
sits:tenant_slo_met_total{model_name="m",slo="ttft",tenant="gold"} 3.0
sits:tenant_slo_met_total{model_name="m",slo="tpot",tenant="gold"} 1.0
# HELP sits:request_queue_time_seconds Queue time.
# TYPE sits:request_queue_time_seconds histogram
sits:request_queue_time_seconds_bucket{le="+Inf",model_name="m"} 5.0
sits:request_queue_time_seconds_count{model_name="m"} 5.0
sits:request_queue_time_seconds_sum{model_name="m"} 0.25
"""


def test_summary_reads_each_tenants_ttft_and_attainment_and_the_queue_time() -> None:
    view = summarize(METRICS)
    gold, burst = view.tenants["gold"], view.tenants["burst"]
    assert (gold.ttft_count, round(gold.ttft_mean_s, 6), gold.ttft_met_pct) == (4, 0.3, 75.0)
    assert (burst.ttft_count, burst.ttft_mean_s, burst.ttft_met_pct) == (0, None, None)
    assert (round(gold.http_ttft_mean_s, 6), burst.http_ttft_mean_s) == (0.4, None)
    assert round(view.queue_mean_s, 6) == 0.05
    assert format_view(view, "qos") == (
        "[qos] server view: burst TTFT mean - from hand-off (0 requests); gold TTFT mean "
        "300.0 ms from hand-off, 400.0 ms from receipt, SLO met 75.0 % (4 requests); engine "
        "queue time mean 50.0 ms"
    )


def test_an_empty_scrape_has_no_tenants() -> None:
    view = summarize("")
    assert view.tenants == {} and view.queue_mean_s is None
    assert format_view(view, "fcfs") == (
        "[fcfs] server view: no tenant TTFTs; engine queue time mean -"
    )
