//! The guest's network configuration, done once by PID 1 at boot: IPv6 off, `eth0` up with a
//! static address, a default route via the sandbox gateway, and the gateway as resolver.
//!
//! Owns: the guest side of the addressing written down in docs/NETWORK.md. The host's stack
//! (`crate::network`) uses the same fixed addresses; a host-side unit test checks they agree.
//! Never: asks anything over the network (no DHCP).

use std::net::Ipv4Addr;

/// The guest's address, prefix and gateway (= resolver). Same values as `network::gate`.
pub const ADDR: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 15);
pub const NETMASK: Ipv4Addr = Ipv4Addr::new(255, 255, 255, 0);
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 0, 2, 2);
pub const IFNAME: &str = "eth0";

/// What `/etc/resolv.conf` says.
pub fn resolv_conf() -> String {
    format!("nameserver {GATEWAY}\noptions edns0\n")
}

/// Disable IPv6, then bring up `eth0` with [`ADDR`] and the default route. IPv6 goes first so
/// the link never gets a link-local address.
pub fn configure() -> std::io::Result<()> {
    for knob in ["all", "default", IFNAME, "lo"] {
        let p = format!("/proc/sys/net/ipv6/conf/{knob}/disable_ipv6");
        // Missing when the kernel has no IPv6 at all: nothing to disable then.
        if std::path::Path::new(&p).exists() {
            std::fs::write(&p, "1")?;
        }
    }
    let sock = Socket::new()?;
    sock.ifreq_addr(libc::SIOCSIFADDR, ADDR)?;
    sock.ifreq_addr(libc::SIOCSIFNETMASK, NETMASK)?;
    sock.up()?;
    sock.default_route(GATEWAY)?;
    let conf = "/etc/resolv.conf";
    if std::fs::symlink_metadata(conf).is_ok_and(|m| m.file_type().is_symlink()) {
        std::fs::remove_file(conf)?;
    }
    std::fs::write(conf, resolv_conf())
}

/// A datagram socket used only for interface ioctls.
struct Socket(libc::c_int);

impl Socket {
    fn new() -> std::io::Result<Socket> {
        // SAFETY: plain socket(2); the fd is owned by the returned value and closed on drop.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Socket(fd))
    }

    fn ifreq() -> libc::ifreq {
        // SAFETY: ifreq is plain data; all-zero is a valid value.
        let mut ifr: libc::ifreq = unsafe { std::mem::zeroed() };
        for (i, b) in IFNAME.bytes().enumerate() {
            ifr.ifr_name[i] = b as libc::c_char;
        }
        ifr
    }

    fn ifreq_addr(&self, req: libc::c_ulong, a: Ipv4Addr) -> std::io::Result<()> {
        let mut ifr = Self::ifreq();
        ifr.ifr_ifru.ifru_addr = sockaddr(a);
        // SAFETY: the ioctl reads the ifreq we own; the fd is valid.
        check(unsafe { libc::ioctl(self.0, req as _, &ifr) })
    }

    fn up(&self) -> std::io::Result<()> {
        let mut ifr = Self::ifreq();
        // SAFETY: SIOCGIFFLAGS/SIOCSIFFLAGS read and write the ifreq we own; the fd is valid.
        check(unsafe { libc::ioctl(self.0, libc::SIOCGIFFLAGS as _, &mut ifr) })?;
        // SAFETY: reading the flags member SIOCGIFFLAGS just filled.
        unsafe {
            ifr.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
        }
        // SAFETY: as above.
        check(unsafe { libc::ioctl(self.0, libc::SIOCSIFFLAGS as _, &ifr) })
    }

    fn default_route(&self, gw: Ipv4Addr) -> std::io::Result<()> {
        // SAFETY: rtentry is plain data (a null rt_dev means "any device"); all-zero is valid.
        let mut rt: libc::rtentry = unsafe { std::mem::zeroed() };
        rt.rt_dst = sockaddr(Ipv4Addr::UNSPECIFIED);
        rt.rt_genmask = sockaddr(Ipv4Addr::UNSPECIFIED);
        rt.rt_gateway = sockaddr(gw);
        rt.rt_flags = libc::RTF_UP | libc::RTF_GATEWAY;
        // SAFETY: SIOCADDRT reads the rtentry we own; the fd is valid.
        let r = check(unsafe { libc::ioctl(self.0, libc::SIOCADDRT as _, &rt) });
        match r {
            Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(()),
            r => r,
        }
    }
}

impl Drop for Socket {
    fn drop(&mut self) {
        // SAFETY: the fd is ours and closed once.
        unsafe { libc::close(self.0) };
    }
}

fn check(r: libc::c_int) -> std::io::Result<()> {
    if r < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

fn sockaddr(a: Ipv4Addr) -> libc::sockaddr {
    let sin = libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: 0,
        sin_addr: libc::in_addr {
            s_addr: u32::from(a).to_be(),
        },
        sin_zero: [0; 8],
    };
    // SAFETY: sockaddr_in and sockaddr have the same size (16 bytes) and sockaddr is plain
    // data; this is how the ioctl ABI passes IPv4 addresses.
    unsafe { std::mem::transmute::<libc::sockaddr_in, libc::sockaddr>(sin) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddr_carries_the_address_in_network_order() {
        let s = sockaddr(Ipv4Addr::new(10, 0, 2, 15));
        assert_eq!(s.sa_family, libc::AF_INET as libc::sa_family_t);
        assert_eq!(
            &s.sa_data[2..6],
            &[10, 0, 2, 15].map(|b: u8| b as libc::c_char)
        );
        assert!(resolv_conf().starts_with("nameserver 10.0.2.2\n"));
    }
}
