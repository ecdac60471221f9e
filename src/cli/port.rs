//! `tryboxi port ID PORT [--host-port N]` (prints the URL), `tryboxi port ID --rm PORT`,
//! `tryboxi port ID` (lists): guest ports forwarded from host loopback ports.

use crate::api;
use crate::error::TopError;

#[derive(Debug, clap::Args)]
pub struct Args {
    /// Sandbox id.
    id: String,
    /// The guest port to expose (none: list the exposed ports).
    #[arg(conflicts_with = "rm")]
    port: Option<u16>,
    /// The host port on 127.0.0.1 (at least 1024); default: a free one.
    #[arg(long, value_name = "N", requires = "port")]
    host_port: Option<u16>,
    /// Stop exposing this guest port.
    #[arg(long, value_name = "PORT")]
    rm: Option<u16>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args) -> Result<(), TopError> {
    let client = super::client()?;
    let path = format!("/v1/sandboxes/{}/ports", a.id);
    let print = |p: &api::ExposedPort| {
        if a.json {
            println!("{}", serde_json::to_string_pretty(p).expect("serializable"));
        } else {
            println!("{}", p.url);
        }
    };
    if let Some(port) = a.rm {
        let p: api::ExposedPort = client
            .send::<(), _>(hyper::Method::DELETE, &format!("{path}/{port}"), None)
            .await?;
        if a.json {
            print(&p);
        } else {
            println!("port {} no longer exposed ({})", p.port, p.url);
        }
        return Ok(());
    }
    if let Some(port) = a.port {
        let req = api::ExposePortRequest {
            port,
            host_port: a.host_port,
        };
        let p: api::ExposedPort = client.send(hyper::Method::POST, &path, Some(&req)).await?;
        print(&p);
        return Ok(());
    }
    let list: api::PortList = client.get(&path).await?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&list).expect("serializable")
        );
        return Ok(());
    }
    println!("{:<6} {:<10} URL", "PORT", "HOST_PORT");
    for p in list.ports {
        println!(
            "{:<6} {:<10} {}{}",
            p.port,
            p.host_port,
            p.url,
            p.error
                .map(|e| format!("  (not listening: {e})"))
                .unwrap_or_default()
        );
    }
    Ok(())
}
