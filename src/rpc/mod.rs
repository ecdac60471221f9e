//! Host <-> guest RPC: length-prefixed bincode frames, message types, stream multiplexing
//! with per-stream flow control. Shared by the daemon and the guest agent; transport-agnostic
//! (virtio-serial by default, vsock where the host offers it).
