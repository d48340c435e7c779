"""The gateway's side of LoRA adapters: which adapters it serves, from the schedulers' views
(the newest wins, so a stale heartbeat never brings back an unloaded adapter), and the
metrics that name them."""

from __future__ import annotations

import time

from common.messages import StatsOut
from common.peers import PeerTable
from services.gateway.lora import AdapterTable
from services.gateway.metrics import Metrics
from services.gateway.tracker import Tracker


def _beat(sid: str, version: int, adapters: dict[str, str], **kw) -> StatsOut:
    return StatsOut(service="scheduler", instance_id=sid, time=time.time(),
                    lora_adapters=adapters, lora_version=version, **kw)


def test_served_adapters_follow_the_newest_view_of_each_live_scheduler():
    peers = PeerTable(heartbeat_timeout=60)
    table = AdapterTable({"pirate": "/a/pirate"}, peers)
    assert table.served() == {"pirate": "/a/pirate"}  # no scheduler yet: --lora-paths
    for beat in (_beat("s1", 1, {"pirate": "/a/pirate"}), _beat("s2", 1, {})):
        peers.record(beat)
        table.on_stats(beat)
    table.record("s2", 5, {"parrot": "/b/parrot"})  # a load's answer
    stale = _beat("s2", 3, {})  # a heartbeat sent before the load
    peers.record(stale)
    table.on_stats(stale)
    assert table.served() == {"pirate": "/a/pirate", "parrot": "/b/parrot"}
    table.record("s1", 6, {})  # pirate unloaded there
    assert table.served() == {"parrot": "/b/parrot"}
    peers.seen[("scheduler", "s2")] -= 120  # s2 dies: its adapters are no longer served
    assert table.served() == {}


def test_metrics_name_running_and_waiting_adapters():
    peers = PeerTable(heartbeat_timeout=60)
    peers.record(_beat("s1", 1, {"a": "/a", "b": "/b"}, lora_running={"a": 2},
                       lora_waiting={"b": 1}, max_lora=4))
    peers.record(_beat("s2", 1, {"a": "/a"}, lora_running={"a": 1}, max_lora=4))
    text = Metrics("tiny", peers, Tracker()).render()[0].decode()
    assert ('tokenline:lora_requests_info{max_lora="4",model_name="tiny",'
            'running_lora_adapters="a",waiting_lora_adapters="b"} 1.0') in text
    assert 'tokenline:lora_requests{lora_name="a",model_name="tiny",state="running"} 3.0' in text
    assert 'tokenline:lora_requests{lora_name="b",model_name="tiny",state="waiting"} 1.0' in text
