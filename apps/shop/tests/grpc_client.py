"""shop's gRPC API from a client not written in Rust: Python's grpcio,
with stubs compiled from apps/shop/proto/shop.proto at run time (by
grpcio-tools' bundled protoc), so the .proto itself is what is tested.

    python grpc_client.py --target 127.0.0.1:PORT --proto-dir apps/shop/proto --account ACC

Prints one JSON object of what it saw; apps/shop/tests/grpc_python.rs
checks it. Exits non-zero, saying why, when grpcio is missing.
"""

import argparse
import importlib
import json
import sys
import tempfile
import threading

try:
    import grpc
    from grpc_tools import protoc
except ImportError as e:  # the test fails loudly, it is never skipped
    sys.exit(f"grpcio and grpcio-tools are needed (bash scripts/test installs them): {e}")


def compile_stubs(proto_dir):
    out = tempfile.mkdtemp(prefix="shop-grpc-")
    code = protoc.main(
        ["protoc", f"-I{proto_dir}", f"--python_out={out}", f"--grpc_python_out={out}", "shop.proto"]
    )
    if code != 0:
        sys.exit(f"protoc failed on {proto_dir}/shop.proto: exit {code}")
    sys.path.insert(0, out)
    return importlib.import_module("shop_pb2"), importlib.import_module("shop_pb2_grpc")


def payment_dict(p):
    return {
        "id": p.id,
        "account_id": p.account_id,
        "amount": p.amount,
        "currency": p.currency,
        "status": p.status,
        "operation_id": p.operation_id,
    }


def main():
    args = argparse.ArgumentParser()
    args.add_argument("--target", required=True)
    args.add_argument("--proto-dir", required=True)
    args.add_argument("--account", required=True)
    a = args.parse_args()
    pb, rpc = compile_stubs(a.proto_dir)
    channel = grpc.insecure_channel(a.target)
    stub = rpc.PaymentsStub(channel)
    who = ("authorization", "Bearer client-1")
    request = pb.CreatePaymentRequest(account_id=a.account, amount=1250, currency="EUR")
    seen = {}

    def code_of(call):
        try:
            call()
            return "OK"
        except grpc.RpcError as e:
            return e.code().name

    seen["missing_key"] = code_of(lambda: stub.CreatePayment(request, metadata=[who]))
    seen["unauthenticated"] = code_of(
        lambda: stub.CreatePayment(request, metadata=[("idempotency-key", "py-1")])
    )
    seen["invalid_amount"] = code_of(
        lambda: stub.CreatePayment(
            pb.CreatePaymentRequest(account_id=a.account, amount=0, currency="EUR"),
            metadata=[who, ("idempotency-key", "py-1")],
        )
    )

    # Eight threads race one key, the bank slow: each gets the payment or
    # ABORTED (in flight), and retries until it has the payment.
    answers, lock = [], threading.Lock()

    def racer():
        while True:
            try:
                reply, call = stub.CreatePayment.with_call(
                    request,
                    metadata=[who, ("idempotency-key", "py-1"), ("x-simulate", "bank-delay=300")],
                )
                md = dict(call.initial_metadata())
                with lock:
                    answers.append((payment_dict(reply), md.get("idempotent-replayed") == "true"))
                return
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ABORTED:
                    with lock:
                        answers.append(({"error": e.code().name}, False))
                    return
                pushback = dict(e.trailing_metadata() or []).get("grpc-retry-pushback-ms")
                threading.Event().wait(min(int(pushback or 100), 1000) / 1000)

    threads = [threading.Thread(target=racer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen["race"] = [a for a, _ in answers]
    seen["race_fresh"] = sum(1 for _, replayed in answers if not replayed)

    reply, call = stub.CreatePayment.with_call(request, metadata=[who, ("idempotency-key", "py-1")])
    seen["replay"] = payment_dict(reply)
    seen["replay_marked"] = dict(call.initial_metadata()).get("idempotent-replayed")
    # The same call sent gzip-compressed is the same call: a replay.
    reply, call = stub.CreatePayment.with_call(
        request, metadata=[who, ("idempotency-key", "py-1")], compression=grpc.Compression.Gzip
    )
    seen["gzip_replay"] = payment_dict(reply)
    seen["gzip_replay_marked"] = dict(call.initial_metadata()).get("idempotent-replayed")
    seen["reused_key"] = code_of(
        lambda: stub.CreatePayment(
            pb.CreatePaymentRequest(account_id=a.account, amount=1251, currency="EUR"),
            metadata=[who, ("idempotency-key", "py-1")],
        )
    )
    got = stub.GetPayment(pb.GetPaymentRequest(id=reply.id), metadata=[who])
    seen["get"] = payment_dict(got)
    seen["get_other_client"] = code_of(
        lambda: stub.GetPayment(
            pb.GetPaymentRequest(id=reply.id), metadata=[("authorization", "Bearer client-2")]
        )
    )
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
