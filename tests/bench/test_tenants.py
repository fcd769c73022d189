"""Multi-tenant workloads and their metrics: proportions, Jain's index, SLO attainment."""

from __future__ import annotations

import pytest

from servelab.bench.config import TenantConfig, WorkloadConfig
from servelab.bench.metrics import RequestRecord
from servelab.bench.tenant_metrics import jain_index, slo_class_summary, tenant_summary
from servelab.bench.workload import TokenSpace, build_workload
from servelab.core.errors import ConfigError
from servelab.core.policy import SLOClass

SPACE = TokenSpace(vocab_size=1000, max_model_len=512, tokenizer=None)


def tenants(**per_tenant: TenantConfig) -> WorkloadConfig:
    return WorkloadConfig(num_requests=300, arrival="poisson", tenants=per_tenant)


def test_tenants_send_their_share_with_their_metadata():
    cfg = tenants(flood=TenantConfig(rate=5.0, priority=2, lengths="fixed", input_len=40, output_len=7),
                  steady=TenantConfig(rate=1.0, slo_class="chat"))
    requests = build_workload(cfg, SPACE)
    flood = [r for r in requests if r.metadata.tenant == "flood"]
    steady = [r for r in requests if r.metadata.tenant == "steady"]
    assert (len(flood), len(steady)) == (250, 50)
    assert {(r.metadata.priority, r.metadata.slo_class) for r in flood} == {(2, None)}
    assert {(r.metadata.priority, r.metadata.slo_class) for r in steady} == {(0, "chat")}
    assert {(len(r.prompt_token_ids), r.max_tokens) for r in flood} == {(40, 7)}
    assert len({len(r.prompt_token_ids) for r in steady}) > 1
    assert [r.arrival_offset_s for r in requests] == sorted(r.arrival_offset_s for r in requests)
    # both send over the same time: 250 at 5/s and 50 at 1/s last about 50 s each
    assert flood[-1].arrival_offset_s == pytest.approx(50, rel=0.3)
    assert steady[-1].arrival_offset_s == pytest.approx(50, rel=0.3)
    assert build_workload(cfg, SPACE, rate=12.0)[-1].arrival_offset_s < requests[-1].arrival_offset_s / 1.5


def test_without_tenants_the_workload_is_unchanged():
    requests = build_workload(WorkloadConfig(num_requests=5), SPACE)
    assert [r.request_id for r in requests] == ["0", "1", "2", "3", "4"]
    assert {r.metadata for r in requests} == {None}


@pytest.mark.parametrize("tenant, message", [
    (TenantConfig(rate=0.0), "workload.tenants.bad.rate must be > 0 requests/s, got 0.0"),
    (TenantConfig(), "workload.tenants.bad.rate must be > 0 requests/s, got None"),
    (TenantConfig(rate=1.0, priority=5000), "workload.tenants.bad.priority must be an integer in [-1000, 1000]"),
    (TenantConfig(rate=1.0, num_requests=0), "workload.tenants.bad.num_requests must be >= 1"),
])
def test_bad_tenants_name_the_field(tenant, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_workload(tenants(good=TenantConfig(rate=1.0), bad=tenant), SPACE)


def test_jain_index():
    assert jain_index([3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 3.0]) == pytest.approx(16 / (2 * 10))
    assert jain_index([0.0, 0.0]) is None and jain_index([]) is None


def record(tenant: str, arrival: float, times: tuple[float, ...], slo_class: str | None = None,
           finish_reason: str | None = "length") -> RequestRecord:
    return RequestRecord(f"{tenant}-{arrival}", arrival, times, 10, len(times), tenant=tenant, slo_class=slo_class,
                         finish_reason=finish_reason)


def test_slo_attainment_counts_refused_requests_as_missed():
    chat = SLOClass(ttft=0.5, tpot=0.1)
    records = [record("a", 0.0, (0.4, 0.5, 0.6), "chat"),            # met
               record("a", 0.0, (0.6, 0.7), "chat"),                 # first token late
               record("a", 0.0, (0.1, 0.5), "chat"),                 # TPOT 0.4 s
               record("a", 0.0, (), "chat", finish_reason="deadline"),  # refused
               record("a", 0.0, (0.2,))]                             # no class: not counted
    summary = slo_class_summary(records, {"chat": chat}, duration=2.0)
    assert summary["slo_classes"]["chat"] == {"requests": 4, "met": 1, "attainment": 0.25, "goodput": 0.5}
    assert summary["slo_class_attainment"] == 0.25 and summary["slo_class_goodput"] == 0.5


def test_service_is_counted_in_the_load_window():
    # a sends at 0 and 10, b at 0 and 10: the window is [0, 10]
    records = [record("a", 0.0, (1.0, 2.0)), record("a", 10.0, (11.0,)),
               record("b", 0.0, (9.0, 12.0)), record("b", 10.0, (20.0,))]
    summary = tenant_summary(records)
    assert summary["fairness"]["window_s"] == 10.0
    # a: 10 prompt + 2 x 2 outputs by t=10; b: 10 prompt + 2 x 1 output
    assert summary["tenants"]["a"]["service_tokens_per_s"] == pytest.approx(1.4)
    assert summary["tenants"]["b"]["service_tokens_per_s"] == pytest.approx(1.2)
    assert summary["fairness"]["service_difference_per_s"] == pytest.approx(0.2)
    assert summary["tenants"]["b"]["refused"] == 0
