//! A small HTTP/1.1 receiver on loopback for HTTP-sink tests: records every request and answers
//! with whatever the test's responder says. Keep-alive, Content-Length bodies only (what ureq
//! sends).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

#[derive(Debug, Clone)]
pub struct Received {
    /// The request target, e.g. "/in".
    pub path: String,
    /// Header names lower-cased.
    pub headers: HashMap<String, String>,
    pub body: Vec<u8>,
    /// The status the responder gave it.
    pub status: u16,
    /// When its body had been read.
    pub at: std::time::SystemTime,
}

pub type Responder = dyn Fn(&Received, usize) -> (u16, Vec<(String, String)>) + Send + Sync;

pub struct Receiver {
    pub port: u16,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    /// Starts listening on 127.0.0.1; `respond(request, index)` picks each answer (and may sleep).
    pub fn start(
        respond: impl Fn(&Received, usize) -> (u16, Vec<(String, String)>) + Send + Sync + 'static,
    ) -> Receiver {
        Receiver::start_on(0, respond)
    }

    /// A loopback port nothing listens on (yet): connections to it are refused.
    pub fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Like `start`, on a given port (0: any).
    pub fn start_on(
        port: u16,
        respond: impl Fn(&Received, usize) -> (u16, Vec<(String, String)>) + Send + Sync + 'static,
    ) -> Receiver {
        let listener = TcpListener::bind(("127.0.0.1", port)).expect("binding a loopback port");
        let port = listener.local_addr().unwrap().port();
        let received = Arc::new(Mutex::new(Vec::new()));
        let respond: Arc<Responder> = Arc::new(respond);
        let shared = received.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let (received, respond) = (shared.clone(), respond.clone());
                std::thread::spawn(move || serve(stream, received, respond));
            }
        });
        Receiver { port, received }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

fn serve(stream: TcpStream, received: Arc<Mutex<Vec<Received>>>, respond: Arc<Responder>) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut headers = HashMap::new();
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
            }
        }
        let len: usize = headers
            .get("content-length")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let mut body = vec![0; len];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let path = line
            .split_whitespace()
            .nth(1)
            .unwrap_or_default()
            .to_string();
        let request = Received {
            path,
            headers,
            body,
            status: 0,
            at: std::time::SystemTime::now(),
        };
        // Recorded before the responder runs (it may take its time, or never answer).
        let index = {
            let mut all = received.lock().unwrap();
            all.push(request.clone());
            all.len() - 1
        };
        let (status, extra) = respond(&request, index);
        received.lock().unwrap()[index].status = status;
        let mut response = format!("HTTP/1.1 {status} X\r\ncontent-length: 0\r\n");
        for (k, v) in extra {
            response.push_str(&format!("{k}: {v}\r\n"));
        }
        response.push_str("\r\n");
        if writer.write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}
