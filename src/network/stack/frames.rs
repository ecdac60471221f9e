//! QEMU's `-netdev stream` framing (a 4-byte big-endian length, then one Ethernet frame, both
//! ways) and the smoltcp [`Device`] the engine feeds: frames in from the guest (already
//! classified), frames out into a bounded write buffer.

use std::collections::VecDeque;

use bytes::{Buf, BufMut, BytesMut};
use smoltcp::phy::{self, Device, DeviceCapabilities, Medium};
use smoltcp::time::Instant;

/// Largest frame accepted from QEMU (virtio-net without offloads sends at most MTU + header;
/// anything bigger is a broken peer).
pub const MAX_FRAME: usize = 65_535;
/// The guest's MTU (IP packet size); frames are this plus the 14-byte Ethernet header.
pub const MTU: usize = 1500;
/// Bytes waiting to be written to QEMU before smoltcp is told the device is busy (it then
/// keeps segments in its socket buffers and retransmits later).
pub const TX_CAP: usize = 256 * 1024;

#[derive(Debug, thiserror::Error)]
#[error("QEMU sent a frame of {0} bytes (more than {MAX_FRAME}): not a -netdev stream peer")]
pub struct FrameTooLarge(pub usize);

/// Splits the byte stream from QEMU into frames.
#[derive(Default)]
pub struct FrameReader {
    buf: BytesMut,
}

impl FrameReader {
    /// Room to read into (at least `n` bytes spare).
    pub fn spare(&mut self, n: usize) -> &mut BytesMut {
        self.buf.reserve(n);
        &mut self.buf
    }

    /// The next complete frame, if any.
    pub fn next_frame(&mut self) -> Result<Option<Vec<u8>>, FrameTooLarge> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > MAX_FRAME {
            return Err(FrameTooLarge(len));
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        self.buf.advance(4);
        Ok(Some(self.buf.split_to(len).to_vec()))
    }
}

/// The smoltcp device: `rx` holds guest frames the classifier let through, `tx` the encoded
/// frames (length prefix included) waiting for the socket.
#[derive(Default)]
pub struct FrameDevice {
    pub rx: VecDeque<Vec<u8>>,
    pub tx: BytesMut,
}

impl FrameDevice {
    /// Mark `n` bytes of `tx` as written to the socket.
    pub fn written(&mut self, n: usize) {
        self.tx.advance(n);
    }
}

pub struct RxToken(Vec<u8>);
pub struct TxToken<'a>(&'a mut BytesMut);

impl phy::RxToken for RxToken {
    fn consume<R, F>(self, f: F) -> R
    where
        F: FnOnce(&[u8]) -> R,
    {
        f(&self.0)
    }
}

impl phy::TxToken for TxToken<'_> {
    fn consume<R, F>(self, len: usize, f: F) -> R
    where
        F: FnOnce(&mut [u8]) -> R,
    {
        let start = self.0.len();
        self.0.put_u32(len as u32);
        self.0.resize(start + 4 + len, 0);
        f(&mut self.0[start + 4..])
    }
}

impl Device for FrameDevice {
    type RxToken<'a> = RxToken;
    type TxToken<'a> = TxToken<'a>;

    fn receive(&mut self, _: Instant) -> Option<(RxToken, TxToken<'_>)> {
        // A reply to a received frame is always allowed: at most one per frame, and frames are
        // only read while `tx` is below its cap.
        let frame = self.rx.pop_front()?;
        Some((RxToken(frame), TxToken(&mut self.tx)))
    }

    fn transmit(&mut self, _: Instant) -> Option<TxToken<'_>> {
        (self.tx.len() < TX_CAP).then_some(TxToken(&mut self.tx))
    }

    fn capabilities(&self) -> DeviceCapabilities {
        let mut caps = DeviceCapabilities::default();
        caps.medium = Medium::Ethernet;
        caps.max_transmission_unit = MTU + 14;
        caps
    }
}

impl FrameDevice {
    /// Whether more guest frames may be read now (the write side is not backed up).
    pub fn accepts_input(&self) -> bool {
        self.tx.len() < TX_CAP && self.rx.len() < 256
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_split_across_reads_are_reassembled() {
        let mut r = FrameReader::default();
        let mut wire = Vec::new();
        for f in [&b"abc"[..], &b""[..], &[7u8; 1514][..]] {
            wire.extend_from_slice(&(f.len() as u32).to_be_bytes());
            wire.extend_from_slice(f);
        }
        let mut out = Vec::new();
        for chunk in wire.chunks(5) {
            r.spare(5).extend_from_slice(chunk);
            while let Some(f) = r.next_frame().unwrap() {
                out.push(f);
            }
        }
        assert_eq!(out, vec![b"abc".to_vec(), vec![], vec![7u8; 1514]]);
    }

    #[test]
    fn oversized_frame_is_refused_before_buffering_it() {
        let mut r = FrameReader::default();
        r.spare(4).extend_from_slice(&(1u32 << 20).to_be_bytes());
        assert!(r.next_frame().is_err());
    }

    #[test]
    fn transmit_stops_when_the_write_buffer_is_full() {
        use smoltcp::phy::TxToken as _;
        let mut d = FrameDevice::default();
        let mut n = 0;
        while let Some(t) = d.transmit(Instant::from_millis(0)) {
            t.consume(1514, |b| b.fill(1));
            n += 1;
            assert!(n < 1000, "transmit never reports a full buffer");
        }
        assert!(d.tx.len() >= TX_CAP && d.tx.len() < TX_CAP + 1600);
        assert_eq!(&d.tx[..4], &1514u32.to_be_bytes());
    }
}
