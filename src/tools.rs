//! Tool calls: a model asked to call functions, and its calls read back out of its reply.
//!
//! sift speaks one format with every model, whatever its chat template: the tools are described
//! in the system message, and a reply that calls them is one compact JSON object,
//! `{"tool_calls":[{"name":"…","arguments":{…}}]}`, with each call's arguments valid under its
//! tool's parameter schema. A [grammar](crate::structured) holds the reply to that: to the object
//! alone when a call is required (or one named function is), or, when the model may choose, to
//! the object or to a plain text that does not begin with `{`. So the first byte of a reply says
//! which it is, and every call read back is well formed.
//!
//! A conversation that goes on after a call carries the call and its results. The call is written
//! back as the model wrote it (the same object, byte for byte, when the arguments are passed back
//! as they came: [`calls_text`]), so that the model reads its own turn again; the results become
//! a user turn, one JSON object listing them ([`results_text`]), since not every template has a
//! role for them.

use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

use crate::chat::Message;
use crate::structured::Format;

/// A function the model may call.
#[derive(Debug, Clone)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON Schema for the arguments (an object); none allows any object.
    pub parameters: Option<Value>,
}

/// What the model must do with its tools.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// Call tools or reply in text, as the model chooses.
    Auto,
    /// Call at least one tool.
    Required,
    /// Call this function.
    Function(String),
}

/// A call the model made: a tool's name and its arguments, a JSON object as the model wrote it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// A tool's answer to a call, for the next turn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolResult {
    /// The tool that answered, where known.
    pub name: Option<String>,
    pub content: String,
}

/// What a reply turned out to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Text(String),
    Calls(Vec<ToolCall>),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolError {
    #[error("tool {0:?}: a name is 1 to 64 letters, digits, '_' or '-'")]
    BadName(String),
    #[error("tool {0:?} is listed twice")]
    Twice(String),
    #[error("tool {0:?}: parameters must be a JSON Schema object")]
    BadParameters(String),
    #[error("tool_choice names {0:?}, which is not among the tools")]
    UnknownChoice(String),
    #[error("tool_choice {0:?} needs tools, and none are given")]
    NoTools(String),
}

/// The tools of one request and what the model must do with them.
#[derive(Debug, Clone)]
pub struct Toolbox {
    tools: Vec<Tool>,
    choice: ToolChoice,
    /// Whether one reply may make more than one call.
    parallel: bool,
}

impl Toolbox {
    pub fn new(tools: Vec<Tool>, choice: ToolChoice, parallel: bool) -> Result<Self, ToolError> {
        for (i, tool) in tools.iter().enumerate() {
            let name = &tool.name;
            let fair = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
            if name.is_empty() || name.len() > 64 || !name.chars().all(fair) {
                return Err(ToolError::BadName(name.clone()));
            }
            if tools[..i].iter().any(|t| t.name == *name) {
                return Err(ToolError::Twice(name.clone()));
            }
            if tool.parameters.as_ref().is_some_and(|p| !p.is_object()) {
                return Err(ToolError::BadParameters(name.clone()));
            }
        }
        match &choice {
            ToolChoice::Function(name) if !tools.iter().any(|t| t.name == *name) => {
                return Err(ToolError::UnknownChoice(name.clone()))
            }
            ToolChoice::Required if tools.is_empty() => return Err(ToolError::NoTools("required".into())),
            _ => {}
        }
        Ok(Self { tools, choice, parallel })
    }

    pub fn choice(&self) -> &ToolChoice {
        &self.choice
    }

    /// What the system message tells the model: the tools, and how to call them.
    pub fn instructions(&self) -> String {
        let mut text = String::from("You can call these tools, each given as a JSON object:\n");
        for tool in self.offered() {
            let mut entry = json!({ "name": tool.name });
            if let Some(description) = &tool.description {
                entry["description"] = json!(description);
            }
            entry["parameters"] = tool.parameters.clone().unwrap_or_else(|| json!({ "type": "object" }));
            text += &entry.to_string();
            text.push('\n');
        }
        let how = if self.parallel { "one or more calls" } else { "one call" };
        text += &format!(
            "To call tools, reply with only this JSON object, {how} in the list: \
             {{\"tool_calls\":[{{\"name\":\"<tool name>\",\"arguments\":{{<arguments>}}}}]}}\n\
             Each tool's answer will come back to you in a message of its own."
        );
        match &self.choice {
            ToolChoice::Auto => text += "\nIf no tool is needed, reply in plain text instead.",
            ToolChoice::Required => text += "\nCall at least one tool now.",
            ToolChoice::Function(name) => text += &format!("\nCall {name} now."),
        }
        text
    }

    /// The tools a reply may call: all of them, or the one named.
    fn offered(&self) -> impl Iterator<Item = &Tool> {
        self.tools.iter().filter(|tool| match &self.choice {
            ToolChoice::Function(name) => tool.name == *name,
            _ => true,
        })
    }

    /// The grammar a reply follows.
    pub fn format(&self) -> Format {
        let call = |tool: &Tool| {
            json!({
                "type": "object",
                "properties": {
                    "name": { "const": tool.name },
                    "arguments": tool.parameters.clone().unwrap_or_else(|| json!({ "type": "object" })),
                },
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        let mut list = json!({ "type": "array", "minItems": 1, "items": { "anyOf": self.offered().map(call).collect::<Vec<_>>() } });
        if !self.parallel {
            list["maxItems"] = json!(1);
        }
        let calls = json!({
            "type": "object",
            "properties": { "tool_calls": list },
            "required": ["tool_calls"],
            "additionalProperties": false,
            // Compact, as `calls_text` writes it back.
            "x-guidance": { "whitespace_flexible": false },
        });
        let text = match self.choice {
            ToolChoice::Auto => " | text\ntext: /(?s:[^{].*)/",
            _ => "",
        };
        Format::Lark(format!("start: calls{text}\ncalls: %json {calls}\n"))
    }

    /// The reply read back: its calls, if it is a whole call object, else its text (a reply cut
    /// short, by the token limit or a stop string, is text).
    pub fn read(&self, reply: &str) -> Reply {
        #[derive(Deserialize)]
        struct Calls<'a> {
            #[serde(borrow)]
            tool_calls: Vec<Call<'a>>,
        }
        #[derive(Deserialize)]
        struct Call<'a> {
            name: String,
            #[serde(borrow)]
            arguments: &'a RawValue,
        }
        if !reply.starts_with('{') {
            return Reply::Text(reply.to_string());
        }
        match serde_json::from_str::<Calls>(reply) {
            Ok(calls) if !calls.tool_calls.is_empty() => Reply::Calls(
                calls
                    .tool_calls
                    .into_iter()
                    .map(|call| ToolCall { name: call.name, arguments: call.arguments.get().to_string() })
                    .collect(),
            ),
            _ => Reply::Text(reply.to_string()),
        }
    }
}

/// Calls as the model writes them, for an assistant turn of the conversation: arguments that are
/// not a JSON object are an error (the text says which).
pub fn calls_text(calls: &[ToolCall]) -> Result<String, String> {
    let mut text = String::from("{\"tool_calls\":[");
    for (i, call) in calls.iter().enumerate() {
        let arguments: &RawValue = serde_json::from_str(call.arguments.trim())
            .map_err(|e| format!("the arguments of {} are not JSON: {e}", call.name))?;
        if !arguments.get().starts_with('{') {
            return Err(format!("the arguments of {} are not a JSON object", call.name));
        }
        if i > 0 {
            text.push(',');
        }
        text += &format!("{{\"name\":{},\"arguments\":{}}}", json!(call.name), arguments.get());
    }
    text += "]}";
    Ok(text)
}

/// Tools' answers, for the user turn that brings them to the model.
pub fn results_text(results: &[ToolResult]) -> String {
    let results: Vec<Value> = results
        .iter()
        .map(|result| match &result.name {
            Some(name) => json!({ "name": name, "content": result.content }),
            None => json!({ "content": result.content }),
        })
        .collect();
    json!({ "tool_results": results }).to_string()
}

/// `messages` with the tools' instructions at the end of the system message (a system message
/// is added where there is none).
pub fn with_instructions(mut messages: Vec<Message>, toolbox: &Toolbox) -> Vec<Message> {
    let instructions = toolbox.instructions();
    match messages.first_mut() {
        Some(first) if first.role == "system" => {
            if !first.content.is_empty() {
                first.content += "\n\n";
            }
            first.content += &instructions;
        }
        _ => messages.insert(0, Message::system(instructions)),
    }
    messages
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weather() -> Tool {
        Tool {
            name: "weather".into(),
            description: Some("Today's weather in a city".into()),
            parameters: Some(json!({ "type": "object", "properties": { "city": { "type": "string" } } })),
        }
    }

    #[test]
    fn a_call_object_reads_back_as_calls_with_the_arguments_as_written() {
        let toolbox = Toolbox::new(vec![weather()], ToolChoice::Auto, true).unwrap();
        let reply =
            r#"{"tool_calls":[{"name":"weather","arguments":{"city": "Oslo"}},{"name":"weather","arguments":{}}]}"#;
        let calls = vec![
            ToolCall { name: "weather".into(), arguments: r#"{"city": "Oslo"}"#.into() },
            ToolCall { name: "weather".into(), arguments: "{}".into() },
        ];
        assert_eq!(toolbox.read(reply), Reply::Calls(calls.clone()));
        // Written back, the calls are the reply again, byte for byte.
        assert_eq!(calls_text(&calls).unwrap(), reply);
        for text in ["It is sunny.", "{\"tool_calls\":[{\"name\":\"weather\",\"argu", "{\"tool_calls\":[]}", ""] {
            assert_eq!(toolbox.read(text), Reply::Text(text.into()), "{text}");
        }
    }

    #[test]
    fn arguments_that_are_not_an_object_cannot_be_written_back() {
        for arguments in ["{\"city\":", "[1]", "\"Oslo\""] {
            let call = ToolCall { name: "weather".into(), arguments: arguments.into() };
            assert!(calls_text(&[call]).unwrap_err().contains("weather"), "{arguments}");
        }
    }

    #[test]
    fn bad_tools_and_choices_are_refused_with_their_reason() {
        let named = |name: &str| Tool { name: name.into(), ..weather() };
        let cases = [
            (vec![named("get weather")], ToolChoice::Auto, ToolError::BadName("get weather".into())),
            (vec![named("")], ToolChoice::Auto, ToolError::BadName("".into())),
            (vec![weather(), weather()], ToolChoice::Auto, ToolError::Twice("weather".into())),
            (
                vec![Tool { parameters: Some(json!([])), ..weather() }],
                ToolChoice::Auto,
                ToolError::BadParameters("weather".into()),
            ),
            (vec![weather()], ToolChoice::Function("time".into()), ToolError::UnknownChoice("time".into())),
            (Vec::new(), ToolChoice::Required, ToolError::NoTools("required".into())),
        ];
        for (tools, choice, error) in cases {
            assert_eq!(Toolbox::new(tools, choice, true).unwrap_err(), error);
        }
    }

    #[test]
    fn the_instructions_join_the_system_message_or_open_the_conversation() {
        let toolbox = Toolbox::new(vec![weather()], ToolChoice::Function("weather".into()), false).unwrap();
        let instructions = toolbox.instructions();
        assert!(instructions.contains(r#""name":"weather""#) && instructions.contains("Call weather now."));
        let with = with_instructions(vec![Message::system("Be brief."), Message::user("Hi")], &toolbox);
        assert_eq!(with[0].content, format!("Be brief.\n\n{instructions}"));
        let without = with_instructions(vec![Message::user("Hi")], &toolbox);
        assert_eq!(without, vec![Message::system(instructions), Message::user("Hi")]);
    }

    #[test]
    fn results_are_one_json_object() {
        let results = [
            ToolResult { name: Some("weather".into()), content: "12 °C, \"rain\"".into() },
            ToolResult { name: None, content: "ok".into() },
        ];
        let text = results_text(&results);
        let value: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(value["tool_results"][0]["content"], "12 °C, \"rain\"");
        assert_eq!(value["tool_results"][1], json!({ "content": "ok" }));
    }
}
