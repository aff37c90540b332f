"""TLS on the controller's one port (issue 6, item 4): the gateway answers HTTPS only, hosts
register and workers announce themselves over wss:// trusting the cluster's CA, and a client
that does not trust it is refused."""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
import ssl
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from flashpoint.rpc.client import TLS_CA_ENV
from flashpoint.testing.harness import ClusterFactory, cluster_config

pytestmark = pytest.mark.timeout(90)


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (its own CA) and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flashpoint-test")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp / "cert.pem", tmp / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


async def test_gateway_and_rpc_over_tls(make_cluster: ClusterFactory,
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cert, key = _self_signed(tmp_path)
    monkeypatch.setenv(TLS_CA_ENV, "")  # restored after the test (the host sets it)
    cfg = cluster_config(tmp_path, tls_ca_path=str(cert))
    cfg = dataclasses.replace(cfg, controller=dataclasses.replace(
        cfg.controller, tls_cert_path=str(cert), tls_key_path=str(key)))
    c = await make_cluster(config=cfg)  # the host registered over wss://
    url = c.controller.url
    assert url.startswith("https://") and c.controller.rpc_url.startswith("wss://")
    trust = ssl.create_default_context(cafile=str(cert))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=trust)) as s:
        async with s.post(f"{url}/v1/functions", json={"name": "tls-fn", "model": "noop"}) as r:
            assert r.status == 201, await r.text()
            inputs = (await r.json())["spec"]["inputs"]
        body = {"inputs": {t["name"]: {"data": [1.0] * 4, "shape": [1, 4],
                                       "datatype": t["datatype"]} for t in inputs}}
        # The worker announced itself to the controller over wss:// to serve this.
        async with s.post(f"{url}/v1/functions/tls-fn/invoke", json=body) as r:
            assert r.status == 200, await r.text()
    # Plain HTTP on the TLS port, and TLS without trusting the CA, are refused.
    async with aiohttp.ClientSession() as s:
        with pytest.raises(aiohttp.ClientError):
            async with s.get(url.replace("https://", "http://") + "/healthz") as r:
                await r.read()
        with pytest.raises(aiohttp.ClientConnectorCertificateError):
            async with s.get(f"{url}/healthz") as r:
                await r.read()
