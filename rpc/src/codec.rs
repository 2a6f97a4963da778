//! The protobuf codec of every layerstream service: prost's, except that a request that does not
//! decode (a string field holding invalid UTF-8, a truncated message) is the caller's error —
//! INVALID_ARGUMENT naming what is wrong — not INTERNAL, which would tell clients the server broke.

use std::marker::PhantomData;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstDecoder, ProstEncoder};

/// prost encoding; decode errors as INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct ProtoCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for ProtoCodec<T, U> {
    fn default() -> Self {
        ProtoCodec(PhantomData)
    }
}

impl<T, U> Codec for ProtoCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = CallerDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        CallerDecoder(ProstDecoder::new(BufferSettings::default()))
    }
}

/// A decode error as the sender's: INVALID_ARGUMENT with prost's reason.
pub fn blame_caller(s: Status) -> Status {
    Status::invalid_argument(format!("the message does not decode: {}", s.message()))
}

/// prost's decoder with its errors blamed on the message's sender.
#[derive(Debug, Clone)]
pub struct CallerDecoder<U>(ProstDecoder<U>);

impl<U: prost::Message + Default> Decoder for CallerDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(blame_caller)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use layerstream_proto::v1::GenerateRequest;

    /// A `prompt` whose bytes are not UTF-8 (field 1, length 2, 0xff 0xfe) is INVALID_ARGUMENT
    /// saying so (end to end over gRPC: tests/hardening.rs).
    #[test]
    fn invalid_utf8_is_the_callers_error() {
        let bad = [0x0a, 0x02, 0xff, 0xfe];
        let e = <GenerateRequest as prost::Message>::decode(&bad[..]).unwrap_err();
        let s = blame_caller(Status::internal(e.to_string()));
        assert_eq!(s.code(), tonic::Code::InvalidArgument);
        assert!(s.message().contains("UTF-8"), "{}", s.message());
    }
}
