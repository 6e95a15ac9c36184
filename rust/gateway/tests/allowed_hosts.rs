//! A gateway that listens on every interface (`0.0.0.0`) still checks `Host`
//! (issue 39): a page whose name an attacker resolves to this machine sends
//! its own name and is refused; the names the operator allows
//! (`--allowed-host`, `LIGHTNING_ALLOWED_HOSTS`), loopback names and the
//! address a connection reached are served. Against a real
//! `lightning-gateway` process.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_lightning-gateway");
const KEY: &str = "admin-key-123";

/// A gateway process, killed on drop.
struct Running(Child, u16, PathBuf);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let _ = std::fs::remove_dir_all(&self.2);
    }
}

/// Starts a gateway on `0.0.0.0:0` with `extra` flags and `env`; waits for
/// its "gateway listening" line and reads the port from it.
fn start(name: &str, extra: &[&str], env: &[(&str, &str)]) -> Running {
    let dir = std::env::temp_dir().join(format!("lightning-hosts-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("{e}"));
    let mut cmd = Command::new(BIN);
    cmd.args(["--listen", "0.0.0.0:0", "--admin-key", KEY, "--db"])
        .arg(dir.join("gw.db"))
        .args(extra)
        .env("RUST_LOG", "info")
        .env_remove("LIGHTNING_ALLOWED_HOSTS")
        .env_remove("LIGHTNING_TOKEN_SECRET")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{BIN}: {e}"));
    let stderr = child.stderr.take().unwrap_or_else(|| panic!("no stderr"));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            // `... gateway listening addr=0.0.0.0:PORT ...` (ANSI colours aside).
            if line.contains("gateway listening") {
                let port = line
                    .split("0.0.0.0:")
                    .nth(1)
                    .map(|r| {
                        r.chars()
                            .take_while(char::is_ascii_digit)
                            .collect::<String>()
                    })
                    .and_then(|p| p.parse::<u16>().ok());
                let _ = tx.send(port);
            }
        }
    });
    let port = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Some(p)) => p,
        other => {
            let _ = child.kill();
            panic!("the gateway did not report its port: {other:?}");
        }
    };
    Running(child, port, dir)
}

/// `GET /rollouts` at `ip:port` with `Host: host`: the status and body.
fn get(ip: IpAddr, port: u16, host: &str) -> (u16, String) {
    let mut s = TcpStream::connect_timeout(&SocketAddr::new(ip, port), Duration::from_secs(10))
        .unwrap_or_else(|e| panic!("{ip}:{port}: {e}"));
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap_or_else(|e| panic!("{e}"));
    write!(
        s,
        "GET /rollouts HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\nConnection: close\r\n\r\n"
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap_or_else(|e| panic!("{e}"));
    let status = out
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, out)
}

/// This machine's address on its default route, if it has one (no packet is
/// sent: connecting a UDP socket only picks the source address).
fn lan_ip() -> Option<IpAddr> {
    let s = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect("192.0.2.1:9").ok()?;
    let ip = s.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

#[test]
fn a_gateway_on_every_interface_serves_only_its_own_and_allowed_names() {
    let lo: IpAddr = [127, 0, 0, 1].into();
    let gw = start("plain", &[], &[]);
    let port = gw.1;
    // A rebinding page's name: refused, in OpenAI's error shape, with the fix named.
    let (s, body) = get(lo, port, &format!("evil.example:{port}"));
    assert_eq!(s, 403, "{body}");
    assert!(body.contains("host_not_allowed"), "{body}");
    assert!(body.contains("--allowed-host"), "{body}");
    // A name the operator did not allow is refused too.
    let (s, _) = get(lo, port, "gw.example");
    assert_eq!(s, 403);
    // Loopback names and the address reached are served.
    for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}")] {
        let (s, body) = get(lo, port, &host);
        assert_eq!(s, 200, "{host}: {body}");
    }
    if let Some(ip) = lan_ip() {
        let reached = match ip {
            IpAddr::V4(v4) => format!("{v4}:{port}"),
            IpAddr::V6(v6) => format!("[{v6}]:{port}"),
        };
        let (s, body) = get(ip, port, &reached);
        assert_eq!(s, 200, "{reached}: {body}");
        // Reaching the LAN address does not make another IP literal its own.
        let (s, _) = get(ip, port, &format!("198.51.100.7:{port}"));
        assert_eq!(s, 403);
    }
    drop(gw);

    // With the operator's names: those work (any case, any port), others do not.
    let gw = start(
        "allowed",
        &[
            "--allowed-host",
            "gw.example",
            "--allowed-host",
            "Other.Example",
        ],
        &[],
    );
    let port = gw.1;
    for host in [
        format!("gw.example:{port}"),
        "GW.EXAMPLE".into(),
        "other.example".into(),
    ] {
        let (s, body) = get(lo, port, &host);
        assert_eq!(s, 200, "{host}: {body}");
    }
    let (s, _) = get(lo, port, &format!("evil.example:{port}"));
    assert_eq!(s, 403);
    drop(gw);

    // The environment variable, comma-separated.
    let gw = start(
        "env",
        &[],
        &[("LIGHTNING_ALLOWED_HOSTS", "a.example,b.example")],
    );
    let port = gw.1;
    assert_eq!(get(lo, port, "b.example").0, 200);
    assert_eq!(get(lo, port, "evil.example").0, 403);
}
