//! The gRPC framing of a unary request: its one length-prefixed message,
//! read within a limit and decompressed, so that the fingerprint is taken
//! over the message itself and not over how it travelled.

use std::io::Read;

use bytes::{Buf, Bytes};
use http::HeaderMap;
use http_body::Body as _;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tonic::{body::Body, Code, Status};

/// The request metadata naming the message's compression.
pub(crate) const GRPC_ENCODING: &str = "grpc-encoding";

/// The encodings whose messages the layer can read.
pub(crate) const READABLE_ENCODINGS: &str = "identity,gzip,deflate";

/// Why a request's message could not be read. Each is answered before
/// anything is claimed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FrameError {
    /// The request (framing included) is larger than the policy allows.
    #[error("the request message is larger than the {max} bytes this method accepts")]
    TooLarge { max: usize },
    /// The body failed while it was read (the client went away).
    #[error("the request could not be read: {0}")]
    Unreadable(String),
    /// Not exactly one well-formed message.
    #[error("{0}")]
    Malformed(&'static str),
    /// Compressed with an encoding this layer cannot read.
    #[error("the message is compressed with {0:?}, which is not supported for this method; send it with one of identity, gzip, deflate")]
    Encoding(String),
    /// The compressed message is corrupt, or expands past the limit.
    #[error("the compressed message could not be read: {0}")]
    Decompress(String),
}

impl FrameError {
    /// The status the client gets.
    pub(crate) fn into_status(self) -> Status {
        let code = match &self {
            FrameError::TooLarge { .. } => Code::ResourceExhausted,
            FrameError::Unreadable(_) => Code::Cancelled,
            FrameError::Malformed(_) | FrameError::Decompress(_) => Code::InvalidArgument,
            FrameError::Encoding(_) => Code::Unimplemented,
        };
        let mut status = crate::LayerRefusal::MessageUnreadable.status(code, self.to_string());
        if code == Code::Unimplemented {
            // What the client may send instead, as gRPC's compression spec
            // asks of a server that cannot read the encoding.
            status.metadata_mut().insert(
                "grpc-accept-encoding",
                tonic::metadata::MetadataValue::from_static(READABLE_ENCODINGS),
            );
        }
        status
    }
}

/// Reads the whole body of a unary request, at most `max` bytes.
pub(crate) async fn read_body(body: Body, max: usize) -> Result<Bytes, FrameError> {
    // The length a client announces is checked before anything is read.
    if body.size_hint().lower() > max as u64 {
        return Err(FrameError::TooLarge { max });
    }
    match Limited::new(body, max).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<LengthLimitError>() => Err(FrameError::TooLarge { max }),
        Err(e) => Err(FrameError::Unreadable(e.to_string())),
    }
}

/// The one message of a unary request body, decompressed per its
/// `grpc-encoding` metadata, at most `max` bytes once decompressed.
pub(crate) fn message(headers: &HeaderMap, body: &Bytes, max: usize) -> Result<Bytes, FrameError> {
    let mut rest = body.clone();
    if rest.len() < 5 {
        return Err(FrameError::Malformed(
            "a unary call must carry exactly one message; this one has none, or a truncated frame",
        ));
    }
    let compressed = match rest.get_u8() {
        0 => false,
        1 => true,
        _ => {
            return Err(FrameError::Malformed(
                "the message frame's compression flag is neither 0 nor 1",
            ))
        }
    };
    let len = rest.get_u32() as usize;
    if rest.len() < len {
        return Err(FrameError::Malformed(
            "the message frame is shorter than its length prefix says",
        ));
    }
    if rest.len() > len {
        return Err(FrameError::Malformed(
            "a unary call must carry exactly one message; this one has more",
        ));
    }
    if !compressed {
        return Ok(rest);
    }
    let encoding = headers
        .get(GRPC_ENCODING)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
        .unwrap_or_default();
    match encoding.as_str() {
        "gzip" => inflate(flate2::read::GzDecoder::new(rest.reader()), max),
        "deflate" => inflate(flate2::read::ZlibDecoder::new(rest.reader()), max),
        "" | "identity" => Err(FrameError::Malformed(
            "the message is flagged compressed but the call names no grpc-encoding",
        )),
        _ => Err(FrameError::Encoding(encoding)),
    }
}

/// Decompresses, refusing more than `max` bytes of output (a small
/// compressed message may expand without bound).
fn inflate(decoder: impl Read, max: usize) -> Result<Bytes, FrameError> {
    let mut out = Vec::new();
    let limit = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
    decoder
        .take(limit)
        .read_to_end(&mut out)
        .map_err(|e| FrameError::Decompress(e.to_string()))?;
    if out.len() > max {
        return Err(FrameError::TooLarge { max });
    }
    Ok(Bytes::from(out))
}

/// `bytes` as one uncompressed gRPC message frame (a message within the
/// layer's body limit, so its length fits the prefix).
pub(crate) fn framed(bytes: &[u8]) -> Bytes {
    let mut out = Vec::with_capacity(bytes.len() + 5);
    out.push(0);
    out.extend_from_slice(&u32::try_from(bytes.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(bytes);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use std::io::Write;

    use super::*;

    fn headers(encoding: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(e) = encoding {
            h.insert(GRPC_ENCODING, e.parse().unwrap());
        }
        h
    }

    fn frame(flag: u8, payload: &[u8]) -> Bytes {
        let mut out = vec![flag];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(payload);
        Bytes::from(out)
    }

    #[test]
    fn one_plain_message() {
        let body = framed(b"\x08\x01");
        assert_eq!(
            message(&headers(None), &body, 100).unwrap(),
            &b"\x08\x01"[..]
        );
        assert_eq!(
            message(&headers(None), &framed(b""), 100).unwrap(),
            &b""[..]
        );
    }

    #[test]
    fn gzip_and_deflate_are_read_as_what_they_carry() {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        gz.write_all(b"hello message").unwrap();
        let body = frame(1, &gz.finish().unwrap());
        assert_eq!(
            message(&headers(Some("gzip")), &body, 100).unwrap(),
            &b"hello message"[..]
        );
        let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
        z.write_all(b"hello message").unwrap();
        let body = frame(1, &z.finish().unwrap());
        assert_eq!(
            message(&headers(Some("deflate")), &body, 100).unwrap(),
            &b"hello message"[..]
        );
    }

    #[test]
    fn a_compression_bomb_stops_at_the_limit() {
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&vec![0u8; 1 << 20]).unwrap();
        let body = frame(1, &gz.finish().unwrap());
        assert!(matches!(
            message(&headers(Some("gzip")), &body, 1000),
            Err(FrameError::TooLarge { max: 1000 })
        ));
        // exactly at the limit is accepted
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        gz.write_all(&[7u8; 1000]).unwrap();
        let body = frame(1, &gz.finish().unwrap());
        assert_eq!(
            message(&headers(Some("gzip")), &body, 1000).unwrap().len(),
            1000
        );
    }

    #[test]
    fn malformed_frames_are_refused_with_what_is_wrong() {
        let cases: [(&[u8], &str); 5] = [
            (b"", "none"),
            (b"\x00\x00\x00", "truncated"),
            (b"\x02\x00\x00\x00\x00", "flag"),
            (b"\x00\x00\x00\x00\x05ab", "shorter"),
            (b"\x00\x00\x00\x00\x01ab", "more"),
        ];
        for (body, says) in cases {
            let e = message(&headers(None), &Bytes::copy_from_slice(body), 100).unwrap_err();
            assert!(e.to_string().contains(says), "{body:?}: {e}");
            assert_eq!(e.into_status().code(), Code::InvalidArgument);
        }
        let flagged = frame(1, b"x");
        let e = message(&headers(None), &flagged, 100).unwrap_err();
        assert_eq!(e.into_status().code(), Code::InvalidArgument);
        let e = message(&headers(Some("zstd")), &flagged, 100).unwrap_err();
        let status = e.into_status();
        assert_eq!(status.code(), Code::Unimplemented);
        assert_eq!(
            status.metadata().get("grpc-accept-encoding").unwrap(),
            READABLE_ENCODINGS
        );
        let e = message(&headers(Some("gzip")), &flagged, 100).unwrap_err();
        assert!(matches!(e, FrameError::Decompress(_)), "{e}");
    }
}
