//! A handler's response body that breaks on the way out, for the tests
//! of what the layer does when an answer's body cannot be read.

use bytes::Bytes;

/// A response body that fails at its first read, or panics there.
pub(crate) struct BrokenBody {
    /// Panics instead of failing.
    pub(crate) panics: bool,
}

impl http_body::Body for BrokenBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        assert!(!self.panics, "the body panicked on purpose");
        std::task::Poll::Ready(Some(Err(std::io::Error::other("the body broke"))))
    }
}
