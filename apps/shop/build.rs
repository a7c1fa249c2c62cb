//! Generates the gRPC service code for `proto/shop.proto` from a
//! description in Rust (tonic-build's manual builder), so that building
//! needs no protobuf compiler. The messages are written out in
//! `src/grpc/pb.rs`; a test drives the service from a client compiled from
//! the `.proto` itself (Python's grpcio), so the two cannot drift apart
//! unnoticed.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let method = |name: &str, route: &str, input: &str| {
        tonic_build::manual::Method::builder()
            .name(name)
            .route_name(route)
            .input_type(format!("super::{input}"))
            .output_type("super::Payment")
            .codec_path("tonic_prost::ProstCodec")
            .build()
    };
    let payments = tonic_build::manual::Service::builder()
        .name("Payments")
        .package("shop.v1")
        .method(method(
            "create_payment",
            "CreatePayment",
            "CreatePaymentRequest",
        ))
        .method(method("get_payment", "GetPayment", "GetPaymentRequest"))
        .build();
    tonic_build::manual::Builder::new()
        .build_transport(false)
        .compile(&[payments]);
}
