//! Why the layer refused a call itself: a `google.rpc.ErrorInfo` in the
//! status's details (`grpc-status-details-bin`), so that a client tells
//! the layer's `FAILED_PRECONDITION` or `INVALID_ARGUMENT` from the
//! handler's own, which share the codes.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use prost::encoding::{decode_key, decode_varint, encode_key, encode_varint, WireType};
use tonic::{Code, Status};

/// The `domain` of the `google.rpc.ErrorInfo` the layer's refusals carry.
pub const ERROR_DOMAIN: &str = "idem";

/// The type URL of `google.rpc.ErrorInfo`, as an `Any` names it.
const ERROR_INFO: &str = "type.googleapis.com/google.rpc.ErrorInfo";

/// Why the layer refused a call (the handler did not run, or its answer
/// could not be given): the `reason` of the `google.rpc.ErrorInfo` detail
/// of its status, in domain [`ERROR_DOMAIN`]. A status the handler
/// returns carries none of these.
///
/// ```
/// use idem_tonic::LayerRefusal;
/// use tonic::{Code, Status};
///
/// let refused = LayerRefusal::KeyReused.status(Code::FailedPrecondition, "the key was used with another message");
/// assert_eq!(LayerRefusal::of(&refused), Some(LayerRefusal::KeyReused));
/// assert_eq!(LayerRefusal::of(&Status::failed_precondition("the handler's own")), None);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LayerRefusal {
    /// No `idempotency-key` where the policy requires one
    /// (`INVALID_ARGUMENT`); reason `IDEMPOTENCY_KEY_MISSING`.
    KeyMissing,
    /// The key is malformed or sent twice (`INVALID_ARGUMENT`); reason
    /// `IDEMPOTENCY_KEY_INVALID`.
    KeyInvalid,
    /// The key was first used with another message or method
    /// (`FAILED_PRECONDITION`); reason `IDEMPOTENCY_KEY_REUSED`.
    KeyReused,
    /// A call with the key is running (`ABORTED`, with a retry hint);
    /// reason `IDEMPOTENCY_KEY_IN_FLIGHT`.
    InFlight,
    /// The store could not be reached; nothing ran (`UNAVAILABLE`); reason
    /// `IDEMPOTENCY_STORE_UNAVAILABLE`.
    StoreUnavailable,
    /// The call's scope is longer than a store keeps (`UNAUTHENTICATED`);
    /// reason `IDEMPOTENCY_SCOPE_TOO_LONG`.
    ScopeTooLong,
    /// [`MetadataScope`](crate::MetadataScope)'s metadata is missing or
    /// invalid (`UNAUTHENTICATED`); reason `IDEMPOTENCY_SCOPE_MISSING`. (A
    /// scope extractor of your own answers with its own status.)
    ScopeMissing,
    /// The message cannot be read: larger than the policy allows
    /// (`RESOURCE_EXHAUSTED`), malformed (`INVALID_ARGUMENT`), in an
    /// encoding the layer does not read (`UNIMPLEMENTED`), or cut off
    /// (`CANCELLED`); reason `IDEMPOTENCY_MESSAGE_UNREADABLE`.
    MessageUnreadable,
    /// The handler failed before giving an answer (it panicked, or its
    /// answer broke off); nothing was stored (`INTERNAL`, or `UNAVAILABLE`
    /// when its outcome is unknown and the key stays held); reason
    /// `IDEMPOTENCY_HANDLER_FAILED`.
    HandlerFailed,
    /// As many guarded handlers run in this process as the layer allows
    /// ([`IdempotencyLayer::max_running`](crate::IdempotencyLayer::max_running)),
    /// those whose callers went away included; nothing was read or claimed
    /// (`UNAVAILABLE`, with a retry hint); reason `IDEMPOTENCY_OVERLOADED`.
    Overloaded,
}

impl LayerRefusal {
    const ALL: [LayerRefusal; 10] = [
        LayerRefusal::KeyMissing,
        LayerRefusal::KeyInvalid,
        LayerRefusal::KeyReused,
        LayerRefusal::InFlight,
        LayerRefusal::StoreUnavailable,
        LayerRefusal::ScopeTooLong,
        LayerRefusal::ScopeMissing,
        LayerRefusal::MessageUnreadable,
        LayerRefusal::HandlerFailed,
        LayerRefusal::Overloaded,
    ];

    /// The `reason` of its `google.rpc.ErrorInfo`.
    pub fn reason(self) -> &'static str {
        match self {
            LayerRefusal::KeyMissing => "IDEMPOTENCY_KEY_MISSING",
            LayerRefusal::KeyInvalid => "IDEMPOTENCY_KEY_INVALID",
            LayerRefusal::KeyReused => "IDEMPOTENCY_KEY_REUSED",
            LayerRefusal::InFlight => "IDEMPOTENCY_KEY_IN_FLIGHT",
            LayerRefusal::StoreUnavailable => "IDEMPOTENCY_STORE_UNAVAILABLE",
            LayerRefusal::ScopeTooLong => "IDEMPOTENCY_SCOPE_TOO_LONG",
            LayerRefusal::ScopeMissing => "IDEMPOTENCY_SCOPE_MISSING",
            LayerRefusal::MessageUnreadable => "IDEMPOTENCY_MESSAGE_UNREADABLE",
            LayerRefusal::HandlerFailed => "IDEMPOTENCY_HANDLER_FAILED",
            LayerRefusal::Overloaded => "IDEMPOTENCY_OVERLOADED",
        }
    }

    /// A status with `code` and `message` that says this refusal in its
    /// details.
    pub fn status(self, code: Code, message: impl Into<String>) -> Status {
        self.mark(Status::new(code, message))
    }

    /// `status` (its code, message and metadata) saying this refusal in
    /// its details.
    pub(crate) fn mark(self, status: Status) -> Status {
        let details = encode(status.code(), status.message(), self.reason());
        Status::with_details_and_metadata(
            status.code(),
            status.message(),
            details,
            status.metadata().clone(),
        )
    }

    /// The refusal `status` says in its details, if the layer refused it.
    pub fn of(status: &Status) -> Option<LayerRefusal> {
        let reason = error_info_reason(status.details())?;
        LayerRefusal::ALL.into_iter().find(|r| r.reason() == reason)
    }
}

/// `google.rpc.Status { code, message, details: [Any(ErrorInfo { reason,
/// domain })] }`, encoded.
fn encode(code: Code, message: &str, reason: &str) -> Bytes {
    let mut info = BytesMut::new();
    text_field(1, reason, &mut info);
    text_field(2, ERROR_DOMAIN, &mut info);
    let mut any = BytesMut::new();
    text_field(1, ERROR_INFO, &mut any);
    bytes_field(2, &info, &mut any);
    let mut status = BytesMut::new();
    encode_key(1, WireType::Varint, &mut status);
    // An int32 is sent as its 64-bit two's complement: gRPC's codes are
    // never negative.
    encode_varint(u64::from(code as i32 as u32), &mut status);
    text_field(2, message, &mut status);
    bytes_field(3, &any, &mut status);
    status.freeze()
}

fn text_field(tag: u32, value: &str, buf: &mut BytesMut) {
    bytes_field(tag, value.as_bytes(), buf);
}

fn bytes_field(tag: u32, value: &[u8], buf: &mut BytesMut) {
    encode_key(tag, WireType::LengthDelimited, buf);
    encode_varint(value.len() as u64, buf);
    buf.put_slice(value);
}

/// The reason of the first `google.rpc.ErrorInfo` in domain
/// [`ERROR_DOMAIN`] among the details of an encoded `google.rpc.Status`;
/// `None` for anything else, a malformed encoding included.
fn error_info_reason(status: &[u8]) -> Option<String> {
    let mut found = None;
    fields(status, |tag, value| {
        if tag != 3 || found.is_some() {
            return Some(());
        }
        let (type_url, info) = fields_1_and_2(value)?;
        if type_url != Some(ERROR_INFO.as_bytes()) {
            return Some(());
        }
        let (reason, domain) = fields_1_and_2(info.unwrap_or_default())?;
        if domain == Some(ERROR_DOMAIN.as_bytes()) {
            found = reason.and_then(|r| std::str::from_utf8(r).ok().map(str::to_owned));
        }
        Some(())
    })?;
    found
}

/// A length-delimited field's bytes, if the message has it.
type Field<'a> = Option<&'a [u8]>;

/// The length-delimited fields 1 and 2 of `message` (the last of each);
/// `None` if the encoding is malformed.
fn fields_1_and_2(message: &[u8]) -> Option<(Field<'_>, Field<'_>)> {
    let (mut one, mut two) = (None, None);
    fields(message, |tag, value| {
        match tag {
            1 => one = Some(value),
            2 => two = Some(value),
            _ => {}
        }
        Some(())
    })?;
    Some((one, two))
}

/// Calls `each` with every length-delimited field of `message` (tag,
/// bytes), skipping the others; `None` if the encoding is malformed.
fn fields<'a>(
    mut message: &'a [u8],
    mut each: impl FnMut(u32, &'a [u8]) -> Option<()>,
) -> Option<()> {
    while message.has_remaining() {
        let (tag, wire) = decode_key(&mut message).ok()?;
        match wire {
            WireType::Varint => {
                decode_varint(&mut message).ok()?;
            }
            WireType::SixtyFourBit => message = message.get(8..)?,
            WireType::ThirtyTwoBit => message = message.get(4..)?,
            WireType::LengthDelimited => {
                let len = usize::try_from(decode_varint(&mut message).ok()?).ok()?;
                let value = message.get(..len)?;
                message = message.get(len..)?;
                each(tag, value)?;
            }
            WireType::StartGroup | WireType::EndGroup => return None,
        }
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_reads_back() {
        for r in LayerRefusal::ALL {
            let s = r.status(Code::FailedPrecondition, "why");
            assert_eq!(LayerRefusal::of(&s), Some(r));
            assert_eq!(s.code(), Code::FailedPrecondition);
            assert_eq!(s.message(), "why");
        }
    }

    #[test]
    fn other_details_are_no_refusal() {
        assert_eq!(LayerRefusal::of(&Status::internal("x")), None);
        let garbage = Status::with_details(Code::Internal, "x", Bytes::from_static(b"\xff\xff"));
        assert_eq!(LayerRefusal::of(&garbage), None);
        // Another domain's ErrorInfo.
        let mut info = BytesMut::new();
        text_field(1, "IDEMPOTENCY_KEY_REUSED", &mut info);
        text_field(2, "example.com", &mut info);
        let mut any = BytesMut::new();
        text_field(1, ERROR_INFO, &mut any);
        bytes_field(2, &info, &mut any);
        let mut status = BytesMut::new();
        bytes_field(3, &any, &mut status);
        let theirs = Status::with_details(Code::Internal, "x", status.freeze());
        assert_eq!(LayerRefusal::of(&theirs), None);
    }
}
