"""The Python mirror of fp_protocol.h agrees with the C header, byte for byte."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from flashpoint.errors import ProtocolError
from flashpoint.gpu import token_protocol as proto
from flashpoint.gpu.hookbuild import HOOK_DIR

PRINTER = r"""
#include <stdio.h>
#include <stddef.h>
#include "fp_protocol.h"
#define F(n) printf("\"%s\": %zu,", #n, offsetof(struct fp_msg, n));
int main(void) {
    printf("{");
    F(magic) F(version) F(type) F(tenant) F(pid) F(seq) F(used_ns) F(requested_ns) F(quota_ns)
    F(mem_used_bytes) F(mem_limit_bytes)
    printf("\"sizeof\": %zu, \"FP_MSG_SIZE\": %d, \"magic_value\": %u, \"version_value\": %u,",
           sizeof(struct fp_msg), FP_MSG_SIZE, FP_MAGIC, FP_PROTOCOL_VERSION);
    printf("\"HELLO\": %d, \"REQUEST\": %d, \"GRANT\": %d, \"RELEASE\": %d, \"MEM\": %d}\n",
           FP_MSG_HELLO, FP_MSG_REQUEST, FP_MSG_GRANT, FP_MSG_RELEASE, FP_MSG_MEM);
    return 0;
}
"""


def test_layout_matches_c_header(tmp_path):
    if not shutil.which("gcc"):
        pytest.skip("needs gcc")
    src = tmp_path / "p.c"
    src.write_text(PRINTER)
    subprocess.run(["gcc", "-I", str(HOOK_DIR), "-o", str(tmp_path / "p"), str(src)], check=True, timeout=60)
    c = json.loads(subprocess.run([str(tmp_path / "p")], capture_output=True, text=True, check=True,
                                  timeout=10).stdout)
    assert {k: c[k] for k in proto.FIELDS} == proto.offsets()
    assert c["sizeof"] == c["FP_MSG_SIZE"] == proto.MSG_SIZE == 64
    assert c["magic_value"] == proto.MAGIC and c["version_value"] == proto.VERSION
    assert {t.name: int(t) for t in proto.MsgType} == {k: c[k] for k in
                                                       ("HELLO", "REQUEST", "GRANT", "RELEASE", "MEM")}


def test_round_trip():
    msg = proto.TokenMsg(proto.MsgType.GRANT, tenant=7, pid=42, seq=2**40, used_ns=5, requested_ns=6,
                         quota_ns=10**7, mem_used_bytes=2**33, mem_limit_bytes=2**34)
    data = proto.pack(msg)
    assert len(data) == proto.MSG_SIZE
    assert proto.unpack(data) == msg
    assert data[:4] == b"FPTK"


@pytest.mark.parametrize("mutate", [
    lambda b: b[:10],  # short
    lambda b: b"XXXX" + b[4:],  # magic
    lambda b: b[:4] + (9).to_bytes(2, "little") + b[6:],  # version
    lambda b: b[:6] + (99).to_bytes(2, "little") + b[8:],  # type
])
def test_malformed_rejected(mutate):
    data = proto.pack(proto.TokenMsg(proto.MsgType.REQUEST, seq=1))
    with pytest.raises(ProtocolError):
        proto.unpack(mutate(data))
