//! The messages of `proto/shop.proto` (package `shop.v1`), and the service
//! code generated for it by `build.rs`. Field numbers and types follow the
//! `.proto` exactly.

/// `shop.v1.CreatePaymentRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CreatePaymentRequest {
    /// The account to charge.
    #[prost(string, tag = "1")]
    pub account_id: String,
    /// In minor units (cents).
    #[prost(int64, tag = "2")]
    pub amount: i64,
    /// Three letters.
    #[prost(string, tag = "3")]
    pub currency: String,
}

/// `shop.v1.GetPaymentRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct GetPaymentRequest {
    /// The payment's id.
    #[prost(string, tag = "1")]
    pub id: String,
}

/// `shop.v1.Payment`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct Payment {
    /// The payment's id (`pay_…`).
    #[prost(string, tag = "1")]
    pub id: String,
    /// The account charged.
    #[prost(string, tag = "2")]
    pub account_id: String,
    /// In minor units.
    #[prost(int64, tag = "3")]
    pub amount: i64,
    /// Three letters.
    #[prost(string, tag = "4")]
    pub currency: String,
    /// `authorized`, `captured` or `settled`.
    #[prost(string, tag = "5")]
    pub status: String,
    /// The operation the payment was made under.
    #[prost(string, tag = "6")]
    pub operation_id: String,
}

include!(concat!(env!("OUT_DIR"), "/shop.v1.Payments.rs"));
