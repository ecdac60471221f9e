//! A look at every guest frame before smoltcp sees it: what kind of traffic it is and whether it
//! may reach smoltcp at all. Pure: no state, no policy.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use smoltcp::wire::{
    EthernetFrame, EthernetProtocol, IpProtocol, Ipv4Packet, TcpPacket, UdpPacket,
};

use crate::network::gate::GUEST_V4;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    /// ARP: smoltcp answers it (as the gateway, and for any address on the subnet).
    Arp,
    /// A TCP segment. `syn` = a connection request (SYN without ACK).
    Tcp {
        src: SocketAddr,
        dst: SocketAddr,
        syn: bool,
    },
    Udp {
        src: SocketAddr,
        dst: SocketAddr,
    },
    /// Never reaches smoltcp.
    Drop(&'static str),
}

/// Classify one Ethernet frame from the guest.
pub fn classify(frame: &[u8]) -> Class {
    let Ok(eth) = EthernetFrame::new_checked(frame) else {
        return Class::Drop("short ethernet frame");
    };
    match eth.ethertype() {
        EthernetProtocol::Arp => Class::Arp,
        EthernetProtocol::Ipv4 => ipv4(eth.payload()),
        EthernetProtocol::Ipv6 => Class::Drop("ipv6"),
        _ => Class::Drop("ethertype"),
    }
}

fn ipv4(p: &[u8]) -> Class {
    let Ok(ip) = Ipv4Packet::new_checked(p) else {
        return Class::Drop("malformed ipv4");
    };
    let src: Ipv4Addr = ip.src_addr();
    let dst: Ipv4Addr = ip.dst_addr();
    if src != GUEST_V4 {
        // The guest has one static address; anything else is spoofed.
        return Class::Drop("ipv4 source is not the guest");
    }
    if ip.more_frags() || ip.frag_offset() != 0 {
        return Class::Drop("ipv4 fragment");
    }
    if !dst_is_unicast(dst) {
        return Class::Drop("ipv4 broadcast or multicast");
    }
    let hl = ip.header_len() as usize;
    let total = (ip.total_len() as usize).min(p.len());
    if total < hl {
        return Class::Drop("malformed ipv4");
    }
    let payload = &p[hl..total];
    match ip.next_header() {
        IpProtocol::Tcp => match TcpPacket::new_checked(payload) {
            Ok(t) => Class::Tcp {
                src: SocketAddr::V4(SocketAddrV4::new(src, t.src_port())),
                dst: SocketAddr::V4(SocketAddrV4::new(dst, t.dst_port())),
                syn: t.syn() && !t.ack() && !t.rst(),
            },
            Err(_) => Class::Drop("malformed tcp"),
        },
        IpProtocol::Udp => match UdpPacket::new_checked(payload) {
            Ok(u) => Class::Udp {
                src: SocketAddr::V4(SocketAddrV4::new(src, u.src_port())),
                dst: SocketAddr::V4(SocketAddrV4::new(dst, u.dst_port())),
            },
            Err(_) => Class::Drop("malformed udp"),
        },
        IpProtocol::Icmp => Class::Drop("icmp"),
        _ => Class::Drop("ip protocol"),
    }
}

fn dst_is_unicast(a: Ipv4Addr) -> bool {
    !(a.is_broadcast()
        || a.is_multicast()
        || a.is_unspecified()
        || a.octets()[3] == 255 && a.octets()[..3] == [10, 0, 2])
}
