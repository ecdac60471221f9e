//! The proxy setting's sources and parsing, the no-proxy matching, and `CONNECT` against a
//! real local proxy.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::*;
use crate::network::upstream_proxy_testkit::{self as kit, Rules};

fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
    move |k| {
        vars.iter()
            .find(|(n, _)| *n == k)
            .map(|(_, v)| v.to_string())
    }
}

fn sa(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

#[test]
fn config_wins_over_env_and_empty_turns_it_off() {
    let e = [
        ("HTTPS_PROXY", "http://envproxy:3128"),
        ("NO_PROXY", "a.test"),
    ];
    let p = resolve(Some("http://cfg:8080"), None, env(&e))
        .unwrap()
        .unwrap();
    assert_eq!(p.display(), "http://cfg:8080");
    assert_eq!(p.source, ProxySource::Config);
    // The no-proxy list still comes from the environment when the config does not set one.
    assert_eq!(p.no_proxy_source, Some(ProxySource::Env("NO_PROXY")));
    assert!(p.bypass(Some("a.test"), sa("1.2.3.4:443")));
    assert!(resolve(Some(""), None, env(&e)).unwrap().is_none());
    let p = resolve(None, Some(&[]), env(&e)).unwrap().unwrap();
    assert_eq!(p.source, ProxySource::Env("HTTPS_PROXY"));
    assert_eq!(p.no_proxy_source, Some(ProxySource::Config));
    assert!(!p.bypass(Some("a.test"), sa("1.2.3.4:443")));
    assert!(resolve(None, None, env(&[])).unwrap().is_none());
}

#[test]
fn env_order_is_https_then_http_then_all_lowercase_first() {
    let e = [
        ("ALL_PROXY", "http://all:1"),
        ("HTTP_PROXY", "http://http:2"),
        ("https_proxy", "  "),
    ];
    let p = resolve(None, None, env(&e)).unwrap().unwrap();
    assert_eq!(
        (p.display(), p.source),
        ("http://http:2".into(), ProxySource::Env("HTTP_PROXY"))
    );
    let e = [
        ("ALL_PROXY", "proxy.corp:3128"),
        ("all_proxy", "http://lower:9"),
    ];
    let p = resolve(None, None, env(&e)).unwrap().unwrap();
    assert_eq!(p.display(), "http://lower:9");
    let p = resolve(None, None, env(&e[..1])).unwrap().unwrap();
    // No scheme means http://, no port means 80.
    assert_eq!(p.display(), "http://proxy.corp:3128");
    assert_eq!(
        resolve(Some("http://p"), None, env(&[]))
            .unwrap()
            .unwrap()
            .display(),
        "http://p:80"
    );
}

#[test]
fn other_schemes_are_refused_without_quoting_credentials() {
    for url in ["socks5://u:hunter2@p:1080", "https://u:hunter2@p:443"] {
        let e = resolve(Some(url), None, env(&[])).unwrap_err().to_string();
        assert!(e.contains("only http://"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
    }
    let e = resolve(None, None, env(&[("ALL_PROXY", "socks5h://p:1")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("$ALL_PROXY") && e.contains("socks5h"), "{e}");
    let e = resolve(Some("http://u:hunter2@p:1/some/path"), None, env(&[]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no path") && !e.contains("hunter2"), "{e}");
    let e = resolve(Some("http://p:1"), Some(&["bad entry!".into()]), env(&[]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("bad entry!"), "{e}");
}

#[test]
fn credentials_are_masked_and_sent_as_basic() {
    let p = resolve(
        Some("http://al%40ice:hun%3Ater2@proxy:3128"),
        None,
        env(&[]),
    )
    .unwrap()
    .unwrap();
    assert_eq!(p.display(), "http://***@proxy:3128");
    let dbg = format!("{p:?}");
    assert!(!dbg.contains("hun") && !dbg.contains("al%40ice"), "{dbg}");
    let b64 = base64::engine::general_purpose::STANDARD.encode("al@ice:hun:ter2");
    assert_eq!(p.auth.as_deref(), Some(format!("Basic {b64}").as_str()));
}

#[test]
fn no_proxy_matches_suffixes_ips_cidrs_ports_and_star() {
    let list: Vec<String> = [
        "example.com",
        ".corp.test",
        "*.wild.test",
        "10.0.0.0/8",
        "192.0.2.7",
        "svc.test:8443",
        "[2001:db8::1]:443",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let p = resolve(Some("http://p:1"), Some(&list), env(&[]))
        .unwrap()
        .unwrap();
    let far = sa("203.0.113.1:443");
    let cases = [
        (Some("example.com"), far, true),
        (Some("API.Example.com."), far, true),
        (Some("notexample.com"), far, false),
        (Some("corp.test"), far, true),
        (Some("a.b.corp.test"), far, true),
        (Some("x.wild.test"), far, true),
        (Some("other.test"), far, false),
        (None, sa("10.9.8.7:22"), true),
        (Some("other.test"), sa("10.9.8.7:443"), true),
        (None, sa("192.0.2.7:80"), true),
        (None, sa("192.0.2.8:80"), false),
        (Some("svc.test"), sa("203.0.113.1:8443"), true),
        (Some("svc.test"), far, false),
        (None, sa("[2001:db8::1]:443"), true),
        (None, sa("[2001:db8::1]:80"), false),
    ];
    for (name, addr, want) in cases {
        assert_eq!(p.bypass(name, addr), want, "{name:?} {addr}");
    }
    let all = resolve(Some("http://p:1"), None, env(&[("no_proxy", "*")]))
        .unwrap()
        .unwrap();
    assert!(all.bypass(Some("anything.test"), far));
    let d = Dial::route(far, Some("example.com"), Some(&Arc::new(p.clone())));
    assert!(d.proxy.is_none());
    let d = Dial::route(far, Some("other.test"), Some(&Arc::new(p)));
    assert!(d.proxy.is_some());
}

async fn echo() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut c, _)) = l.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = c.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    a
}

#[tokio::test]
async fn dial_tunnels_by_name_with_basic_auth_and_reports_refusals() {
    let up = echo().await;
    let b64 = base64::engine::general_purpose::STANDARD.encode("u:s3cretpw");
    let proxy = kit::start(Rules {
        map: HashMap::from([("named.test:443".to_owned(), up)]),
        refuse: HashMap::from([("denied.test:443".to_owned(), 403)]),
        require_auth: Some(format!("Basic {b64}")),
    })
    .await;
    let url = format!("http://u:s3cretpw@{}", proxy.addr);
    let p = Arc::new(resolve(Some(&url), None, env(&[])).unwrap().unwrap());
    let dst = sa("203.0.113.5:443");
    let mut s = Dial::route(dst, Some("named.test"), Some(&p))
        .connect()
        .await
        .unwrap();
    s.write_all(b"ping").await.unwrap();
    let mut b = [0u8; 4];
    s.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"ping");
    let e = Dial::route(dst, Some("denied.test"), Some(&p))
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("403") && e.contains("denied.test:443"), "{e}");
    assert!(!e.contains("s3cretpw") && !e.contains(&b64), "{e}");
    // Wrong credentials: 407, and the error names neither the old nor the new secret.
    let url = format!("http://u:wrongpw@{}", proxy.addr);
    let bad = Arc::new(resolve(Some(&url), None, env(&[])).unwrap().unwrap());
    let e = Dial::route(dst, Some("named.test"), Some(&bad))
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("407") && !e.contains("wrongpw"), "{e}");
    assert_eq!(
        proxy.seen.connects(),
        ["named.test:443", "denied.test:443", "named.test:443"]
    );
    // No name: the IP is the target.
    let _ = Dial::route(dst, None, Some(&p)).connect().await;
    assert_eq!(proxy.seen.connects().last().unwrap(), "203.0.113.5:443");
}

#[tokio::test]
async fn an_unreachable_proxy_is_a_clear_error() {
    // A port nothing listens on (bound, then closed).
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dead = l.local_addr().unwrap();
    drop(l);
    let url = format!("http://u:pw123456@{dead}");
    let p = Arc::new(resolve(Some(&url), None, env(&[])).unwrap().unwrap());
    let e = Dial::route(sa("203.0.113.5:443"), Some("x.test"), Some(&p))
        .connect()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unreachable") && e.contains(&dead.to_string()),
        "{e}"
    );
    assert!(!e.contains("pw123456"), "{e}");
}

#[test]
fn routing_loopback_always_direct_names_only_by_portless_entries_and_connect_target() {
    let list: Vec<String> = ["corp.test", "svc.test:8443", "10.0.0.0/8"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let p = Arc::new(
        resolve(Some("http://p:1"), Some(&list), env(&[]))
            .unwrap()
            .unwrap(),
    );
    // Loopback (only test overrides map flows there) never goes through the proxy.
    for a in [
        "127.0.0.1:443",
        "127.8.9.1:80",
        "[::1]:443",
        "[::ffff:127.0.0.1]:443",
    ] {
        assert!(p.bypass(Some("far.test"), sa(a)), "{a}");
        assert!(!Dial::route(sa(a), None, Some(&p)).via_proxy(), "{a}");
    }
    // Whether a lookup may be answered for the proxy: not for names the list sends directly
    // on every port; a port-bound entry leaves the other ports to the proxy.
    assert!(!p.proxies_name("corp.test") && !p.proxies_name("a.CORP.test."));
    assert!(p.proxies_name("svc.test") && p.proxies_name("far.test"));
    let all = resolve(Some("http://p:1"), Some(&["*".to_owned()]), env(&[]))
        .unwrap()
        .unwrap();
    assert!(!all.proxies_name("far.test"));
    // The CONNECT target: the checked name, else the address (IPv6 in brackets).
    let far = sa("203.0.113.9:443");
    let d = Dial::route(far, Some("far.test"), Some(&p));
    assert!(d.via_proxy());
    assert_eq!(d.target_host(), "far.test");
    let d = Dial::route(far, None, Some(&p));
    assert_eq!(d.target_host(), "203.0.113.9");
    // No proxy at all: direct, whatever the name.
    assert!(!Dial::route(far, Some("far.test"), None).via_proxy());
    assert!(!Dial::direct(far, Some("far.test")).via_proxy());
}
