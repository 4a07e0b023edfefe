"""``spec.inferencePool``: the InferencePool the Gateway API Inference Extension routes to.
Every rendered pool is valid, strictly, against the vendored GAIE release's CRD; it selects
exactly the serving Service's pods; the real operator applies it on a cluster that serves
the API (kmock's emulator over HTTP), says what to install where it does not, and deletes
it when the spec drops it."""

from __future__ import annotations

import jsonschema
import pytest
import yaml
from operator_harness import eventually, ready_for, running_operator, service_manifest
from spec_helpers import spec_of
from vendored_crds import DATA, check_release, header_and_body, strict_version_schema

from kvledger.engine.errors import BadInput
from kvledger.engine.settings.kv_events_config import KVEventsConfig
from kvledger.operator.api.resource import API_VERSION, PLURAL
from kvledger.operator.api.spec import parse_spec
from kvledger.operator.render.gateway import (
    GAIE_RELEASE,
    INFERENCE_POOLS,
    POOL_API_VERSION,
    render_inference_pool,
)
from kvledger.operator.render.policy import Policy
from kvledger.operator.render.render import (
    INFERENCE_SERVING_LABEL,
    GatewayWiring,
    render_deployment,
)
from kvledger.operator.render.render_group import (
    render_leader_worker_set,
    render_serving_service,
)

CRD = DATA / "gaie" / "inference.networking.k8s.io_inferencepools.yaml"
MODEL = {"path": "/models/m", "volume": {"persistentVolumeClaim": {"claimName": "models"},
                                         "mountPath": "/models"}}
SPECS = {
    "one pod a replica": {"model": MODEL, "replicas": 3,
                          "inferencePool": {"endpointPicker": {"name": "chat-epp"}}},
    "a group's leaders, its own port and FailOpen": {
        "model": MODEL, "gpus": 2, "nodes": 2, "port": 9000,
        "inferencePool": {"endpointPicker": {"name": "epp", "port": 9100,
                                             "failureMode": "FailOpen"}}},
    "the admin's picker": {"model": MODEL, "inferencePool": {}},
}


@pytest.fixture(scope="module")
def pool_schema() -> dict:
    return strict_version_schema(CRD, "v1")


def test_the_vendored_crd_is_the_release_file_its_header_names():
    check_release(CRD, GAIE_RELEASE)
    crd = yaml.safe_load(header_and_body(CRD)[1])
    assert crd["spec"]["group"] == POOL_API_VERSION.split("/")[0]


@pytest.mark.parametrize("raw", SPECS.values(), ids=SPECS.keys())
def test_rendered_pools_are_valid_and_select_the_serving_pods(raw, pool_schema):
    spec = parse_spec(raw)
    pool = render_inference_pool("chat", "team-a", spec, "default-epp")
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
              for e in jsonschema.Draft4Validator(pool_schema).iter_errors(pool)]
    assert not errors, errors[:5]
    service = render_serving_service("chat", "team-a", spec)
    assert pool["spec"]["selector"]["matchLabels"] == service["spec"]["selector"]
    assert pool["spec"]["targetPorts"] == [{"number": spec.serve.port}]
    picker = pool["spec"]["endpointPickerRef"]
    expected = raw["inferencePool"].get("endpointPicker", {})
    assert picker["name"] == expected.get("name", "default-epp")
    assert picker["port"] == {"number": expected.get("port", 9002)}
    assert picker["failureMode"] == expected.get("failureMode", "FailClose")


def test_no_pool_without_the_spec_and_none_without_a_picker():
    plain = parse_spec({"model": MODEL})
    assert render_inference_pool("chat", "ns", plain, "epp") is None
    nameless = parse_spec({"model": MODEL, "inferencePool": {}})
    with pytest.raises(BadInput, match=r"gateway\.endpointPicker\.name"):
        render_inference_pool("chat", "ns", nameless)
    with pytest.raises(BadInput, match="needs its Endpoint Picker"):
        Policy().check(nameless, "kvledger:test")
    admin = Policy.from_json('{"gateway": {"endpointPicker": {"name": "epp", "port": 9003}}}')
    admin.check(nameless, "kvledger:test")
    assert (admin.picker, admin.picker_port) == ("epp", 9003)
    with pytest.raises(BadInput, match=r"gateway\.endpointPicker"):
        Policy.from_json('{"gateway": {"endpointPicker": {"port": 0}}}')


def test_the_gateways_fairness_header_is_believed_from_the_admins_addresses_alone():
    pooled = parse_spec(SPECS["one pod a replica"])

    def engine_args(spec, **options):
        pod = render_deployment("chat", "ns", spec_of(spec), **options)["spec"]["template"]["spec"]
        return pod["containers"][0]["args"]

    args = engine_args(pooled, gateway=GatewayWiring(peers=("10.8.0.0/16", "10.9.1.2")))
    assert args[-9:-4] == ["--tenant-header", "x-gateway-inference-fairness-id",
                           "--tenant-header-from", "10.8.0.0/16", "10.9.1.2"]
    assert args[-4:-2] == ["--objective-header", "x-gateway-inference-objective"]
    assert "--tenant-header" not in engine_args(pooled)  # no addresses: nobody's to set
    plain = parse_spec({"model": MODEL})
    assert "--tenant-header" not in engine_args(plain, gateway=GatewayWiring(("10.8.0.0/16",)))
    admin = Policy.from_json('{"gateway": {"addresses": ["10.8.0.0/16"]}}')
    assert admin.gateway.peers == ("10.8.0.0/16",)
    for bad in ('{"gateway": {"addresses": ["gateway.local"]}}', '{"gateway": []}',
                '{"gateway": {"endpointPicker": "epp"}}'):
        with pytest.raises(BadInput, match="KVLEDGER_POLICY: gateway"):
            Policy.from_json(bad)


def test_engines_behind_a_pool_publish_kv_events_to_the_admins_router_alone():
    """gateway.kvEvents.endpoint (the router's address): the engines of a service behind
    an InferencePool connect there and publish under llm-d's topic kv@<pod IP>@<model>,
    keyed as llm-d computes keys (sha256_cbor); other services and other admins' clusters
    publish nothing, and an address the engines would bind (a wildcard) is refused."""
    pooled = parse_spec(SPECS["one pod a replica"])
    admin = Policy.from_json('{"gateway": {"kvEvents": {"endpoint": '
                             '"tcp://epp-kv.gateway.svc:5557"}}}')
    pod = render_deployment("chat", "ns", spec_of(pooled), gateway=admin.gateway)["spec"]["template"]
    engine = pod["spec"]["containers"][0]
    flags = engine["args"][engine["args"].index("--kv-events-config"):]
    config = KVEventsConfig.parse(flags[1])  # what the engine will read
    assert (config.enabled, config.endpoint) == (True, "tcp://epp-kv.gateway.svc:5557")
    assert config.topic == f"kv@$(POD_IP)@{pooled.engine.served_model_name}"
    assert flags[2:4] == ["--prefix-caching-hash-algo", "sha256_cbor"]
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} \
        in engine["env"]
    plain = render_deployment("chat", "ns", parse_spec({"model": MODEL}), gateway=admin.gateway)
    plain_engine = plain["spec"]["template"]["spec"]["containers"][0]
    assert "--kv-events-config" not in plain_engine["args"]
    assert "POD_IP" not in {var["name"] for var in plain_engine.get("env", [])}
    unset = render_deployment("chat", "ns", spec_of(pooled), gateway=Policy().gateway)
    assert "--kv-events-config" not in unset["spec"]["template"]["spec"]["containers"][0]["args"]
    assert Policy.from_json('{"gateway": {"kvEvents": {"endpoint": "tcp://r:1", '
                            '"hashAlgo": "sha256"}}}').gateway.hash_algo == "sha256"
    for bad in ('"tcp://*:5557"', '"tcp://[::]:5557"', '"ipc:///tmp/kv"', '"tcp://r:0"',
                '"tcp://r"', '5557'):
        with pytest.raises(BadInput, match=r"gateway\.kvEvents"):
            Policy.from_json(f'{{"gateway": {{"kvEvents": {{"endpoint": {bad}}}}}}}')
    with pytest.raises(BadInput, match=r"gateway\.kvEvents"):
        Policy.from_json('{"gateway": {"kvEvents": {"endpoint": "tcp://r:1", '
                         '"hashAlgo": "xxhash"}}}')


def test_only_serving_pods_carry_the_serving_and_engine_type_labels():
    """The router's metrics extractor picks the metric names by ``llm-d.ai/engine-type``
    (its default engine when absent, which an admin may set to another): vllm's are ours."""
    pooled = parse_spec(SPECS["one pod a replica"])
    labels = render_deployment("chat", "ns", spec_of(pooled))["spec"]["template"]["metadata"]["labels"]
    assert labels[INFERENCE_SERVING_LABEL] == "true"
    assert labels["llm-d.ai/engine-type"] == "vllm"
    plain = render_deployment("chat", "ns", parse_spec({"model": MODEL}))
    assert INFERENCE_SERVING_LABEL not in plain["spec"]["template"]["metadata"]["labels"]
    assert "llm-d.ai/engine-type" not in plain["spec"]["template"]["metadata"]["labels"]
    group = render_leader_worker_set("chat", "ns", spec_of(SPECS["a group's leaders, its own port and "
                                                         "FailOpen"]), key_secret="k")
    templates = group["spec"]["leaderWorkerTemplate"]
    assert templates["leaderTemplate"]["metadata"]["labels"][INFERENCE_SERVING_LABEL] == "true"
    assert INFERENCE_SERVING_LABEL not in templates["workerTemplate"]["metadata"]["labels"]
    assert "llm-d.ai/engine-type" not in templates["workerTemplate"]["metadata"]["labels"]


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_the_operator_applies_and_deletes_the_pool():
    async with running_operator(pool=True) as cluster:
        manifest = service_manifest("chat", inferencePool={"endpointPicker": {"name": "epp"}})
        await cluster.create(API_VERSION, PLURAL, manifest)
        pool = await eventually(lambda: cluster.stored(*INFERENCE_POOLS, "default", "chat"),
                                what="inferencepool")
        owner = cluster.stored(API_VERSION, PLURAL, "default", "chat")
        [ref] = pool["metadata"]["ownerReferences"]
        assert ref["uid"] == owner["metadata"]["uid"]
        assert pool["spec"]["endpointPickerRef"]["name"] == "epp"
        await cluster.patch(API_VERSION, PLURAL, "default", "chat",
                            {"spec": {"inferencePool": None}})
        await eventually(lambda: cluster.stored(*INFERENCE_POOLS, "default", "chat") is None,
                         what="the pool deleted")


@pytest.mark.timeout(60)
@pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")
async def test_a_cluster_without_the_crd_is_told_what_to_install():
    async with running_operator(pool=False) as cluster:
        manifest = service_manifest("chat", inferencePool={"endpointPicker": {"name": "epp"}})
        await cluster.create(API_VERSION, PLURAL, manifest)
        ready = await ready_for(cluster, "chat", "InferencePoolMissing")
        assert ready["status"] == "False" and GAIE_RELEASE in ready["message"]
        assert cluster.stored("apps/v1", "deployments", "default", "chat") is None
