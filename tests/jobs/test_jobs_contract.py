"""The job subjects are in the machine-readable contract, and what a real worker sends validates against it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
from nats.js.api import DeliverPolicy

from bus.contract import subjects
from bus.contract.schema import asyncapi
from tests.helpers import arun, connect_nats


def schema(doc: dict[str, Any], channel: str, part: str) -> jsonschema.Draft202012Validator:
    ref = doc["components"]["messages"][f"{channel}_{part}"]["payload"]
    return jsonschema.Draft202012Validator({**ref, "components": doc["components"]})


def test_job_replies_and_events_validate(
    nats_url: str, worker_factory: Callable[..., object], unique: Callable[[str], str]
) -> None:
    region, app = unique("r"), unique("a")
    worker_factory(region, cpus=1)
    doc = asyncapi()
    submit = {"app": app, "cmd": ["true"], "runner": "process"}
    schema(doc, "jobs_submit", "payload").validate(submit)

    async def main() -> dict[str, Any]:
        nc = await connect_nats(nats_url)
        try:
            # subscribed before the submit, from the stream's start: every event of the job is after it
            js = nc.jetstream()
            sub = await js.subscribe(
                subjects.job_events_filter(app), ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
            )
            made = json.loads(
                (await nc.request(subjects.api_jobs_submit(app, region), json.dumps(submit).encode(), timeout=10)).data
            )
            job_id = made["jobs"][0]["id"]
            events = [json.loads((await sub.next_msg(timeout=30)).data)]
            while events[-1]["state"] not in ("succeeded", "failed", "cancelled"):
                events.append(json.loads((await sub.next_msg(timeout=30)).data))
            status = await nc.request(
                subjects.api_jobs(app, "status"), json.dumps({"app": app, "id": job_id}).encode(), timeout=5
            )
            listed = await nc.request(subjects.api_jobs(app, "list"), json.dumps({"app": app}).encode(), timeout=5)
            return {"made": made, "events": events, "status": json.loads(status.data), "list": json.loads(listed.data)}
        finally:
            await nc.close()

    seen = arun(main())
    schema(doc, "jobs_submit", "reply").validate(seen["made"])
    schema(doc, "jobs_status", "reply").validate(seen["status"])
    schema(doc, "jobs_list", "reply").validate(seen["list"])
    for event in seen["events"]:
        schema(doc, "job_events", "payload").validate(event)
    assert [e["state"] for e in seen["events"]] == ["queued", "running", "succeeded"]
