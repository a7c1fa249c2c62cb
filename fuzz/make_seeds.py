#!/usr/bin/env python3
"""Writes the seed corpus (fuzz/corpus/<target>/seed-*): small, meaningful
inputs for each target. Run from anywhere: python3 fuzz/make_seeds.py

Header blobs are written in the format of StoredResponse::encode_headers
(crates/idem-core/src/record.rs): for each header a u16 big-endian name length,
the name, a u32 big-endian value length, the value. The record_decoding
target checks that every blob it decodes encodes back to the same bytes, so
running it over these seeds checks they are what encode_headers writes.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def headers(pairs):
    out = b""
    for name, value in pairs:
        name = name.encode() if isinstance(name, str) else name
        value = value.encode() if isinstance(value, str) else value
        out += struct.pack(">H", len(name)) + name + struct.pack(">I", len(value)) + value
    return out


# key_parser: one header value; '\n' separates values for from_header_values.
keys = {
    "bare": "order-42",
    "quoted": '"order-42"',
    "quoted-escapes": r'"a\"b\\c"',
    "bare-quote-and-backslash": r'a"b\c',
    "uuid-quoted": '"8e03978e-40d5-43e8-bc93-6894a57f9324"',
    "ows": "  k1\t",
    "unicode-bare": "caf\u00e9",
    "unicode-quoted": '"caf\u00e9"',
    "empty-quoted": '""',
    "key-starting-with-quote": r'"\"abc"',
    "len-255": "a" * 255,
    "len-256-quoted": '"' + "b" * 256 + '"',
    "params": '"abc";p=1',
    "token-not-string": "abc;p=1",
    "bad-escape": r'"a\qb"',
    "unterminated": '"abc',
    "trailing": '"abc"x',
    "space-inside": '"a b"',
    "control": "a\x01",
    "all-visible": bytes(range(0x21, 0x7F)),
    "two-values": "k1\nk1",
    "one-quoted-one-bare": '"k1"\nk1',
}
for name, data in keys.items():
    write("key_parser", name, data)

# canonical_json: a body; or "method\npath\ncontent-type\nbody".
bodies = {
    "payment": '{"account_id":"acc_1","amount":1000,"currency":"EUR"}',
    "payment-pretty": '{\n  "currency" : "EUR",\n  "amount" : 1e3,\n  "account_id" : "acc_1"\n}\n',
    "nested-escapes": r'{"b":[1.0,"\u0041\n\t\"\\\/",{"z":null,"a":[true,false]}],"a":{"\u00e9":"\ud83d\ude00"}}',
    "numbers": "[0,-0,1.0,1e2,0.5e1,1e21,1e-7,123456789012345678901234567890,18446744073709551615,18446744073709551616,-9223372036854775808,9007199254740993,1.7976931348623157e308,5e-324,0.1,2.5E-3]",
    "number-out-of-range": "[1e400]",
    "long-fraction": "0.30000000000000000000000000000000000001",
    "exact-amounts": '{"wei":[10000000000000000000001,1.0000000000000000000001e22,9.000000000000001,9007199254740993.0,1e-400,-25e-401,0.00000012345678901234567],"x":{"b":1.00000000000000001,"a":-123456789012345678901.5}}',
    "exponent-beyond-64-bits": "[1e-99999999999999999999,0e-99999999999999999999]",
    "controls-and-separators": '"\\u0000\\u001f\\u007f\\u2028\\u2029\u00e9"',
    "utf16-key-order": '{"\ue000":1,"\U0001F600":2,"a":3,"\u00e9":4}',
    "duplicate-keys": '{"a":1,"a":2}',
    "deep": "[" * 40 + "{}" + "]" * 40,
    "too-deep": "[" * 200 + "]" * 200,
    "not-json": "{not json",
    "trailing-garbage": '{"a":1} x',
    "lone-surrogate": '"\\ud800"',
    "request": 'POST\n/payments?x=1\napplication/json; charset=utf-8\n{"amount": 100, "currency": "EUR"}',
    "request-merge-patch": 'PATCH\n/orders/1\nApplication/Merge-Patch+JSON\n{"status":"paid"}',
    "request-text": "POST\n/p\ntext/plain\n{ \"a\":1}",
}
for name, data in bodies.items():
    write("canonical_json", name, data)

typical = [
    ("location", "/payments/pay_01"),
    ("content-type", "application/json"),
    ("etag", '"v1"'),
    ("retry-after", "1"),
]
odd = [
    ("x-bin", b"\xff\x00a"),
    ("empty", b""),
    ("Upper-Case", "v"),
    ("bad name", "v"),
    ("", "no name"),
    ("x-newline", "a\r\nb"),
    ("x-obs-text", b"caf\xe9"),
    ("idempotent-replayed", "false"),
    ("x-rep", "1"),
    ("x-rep", "2"),
]

# record_decoding: mode byte 0 = header blob, 1 = row, 2 = arbitrary record.
write("record_decoding", "headers-typical", b"\x00" + headers(typical))
write("record_decoding", "headers-odd", b"\x00" + headers(odd))
write("record_decoding", "headers-empty", b"\x00")
write("record_decoding", "headers-truncated", b"\x00" + headers(typical)[:-1])
write("record_decoding", "headers-name-not-utf8", b"\x00" + headers([(b"\xc3\x28", "v")]))


def field(b):
    b = b.encode() if isinstance(b, str) else b
    return struct.pack(">H", len(b)) + b


def opt_int(v):
    return b"\x00" if v is None else b"\x01" + struct.pack(">q", v)


def opt_bytes(v):
    return b"\x00" if v is None else b"\x01" + field(v)


def row(state, op="0190f1a2-3b4c-7d5e-8f60-718293a4b5c6", fp=bytes(range(32)), token=None,
        locked_until=None, completed_at=None, status=None, hdrs=None, body=None):
    return (b"\x01" + field("client-1") + field("order-42") + field(fp) + field(op) + field(state)
            + opt_int(token) + opt_int(locked_until) + struct.pack(">q", 1_700_000_000_000)
            + struct.pack(">q", 1_700_086_400_000) + opt_int(completed_at) + opt_int(status)
            + opt_bytes(hdrs) + opt_bytes(body))


done = dict(completed_at=1_700_000_001_000, status=201, hdrs=headers(typical),
            body='{"id":"pay_01","amount":1000}')
write("record_decoding", "row-completed", row("completed", **done))
write("record_decoding", "row-in-progress", row("in_progress", token=4242, locked_until=1_700_000_030_000))
write("record_decoding", "row-uuid-uppercase-braced",
      row("completed", op="{0190F1A2-3B4C-7D5E-8F60-718293A4B5C6}", **done))
write("record_decoding", "row-status-too-big", row("completed", **{**done, "status": 70000}))
write("record_decoding", "row-short-fingerprint", row("in_progress", fp=b"\x07" * 3, token=1, locked_until=2))
write("record_decoding", "row-unknown-state", row("weird", token=1, locked_until=2))
write("record_decoding", "row-headers-corrupt", row("completed", **{**done, "hdrs": b"\x00\x09loc"}))
write("record_decoding", "row-missing-body", row("completed", **{**done, "body": None}))
write("record_decoding", "record-arbitrary", b"\x02" + bytes(range(1, 120)))

# header_replay: mode byte 0 = stored blob, 1 = arbitrary pairs, 2 = many.
write("header_replay", "stored-typical", b"\x00" + headers(typical))
write("header_replay", "stored-odd", b"\x00" + headers(typical + odd))
write("header_replay", "stored-truncated", b"\x00" + headers(odd)[:-3])
write("header_replay", "pairs", b"\x01" + b"location\x00/p\x01x-y\x00\xff" * 3)
write("header_replay", "many-distinct", b"\x02\x00\x10\x01value")
write("header_replay", "many-repeated", b"\x02\x01\x00\x00v")
